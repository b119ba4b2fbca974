"""datatrove's SlurmPipelineExecutor as compass submits it: a module of its own because the array tasks unpickle
the executor, and its class must be importable there."""

from __future__ import annotations

from datatrove.executor import SlurmPipelineExecutor


class ArrayExecutor(SlurmPipelineExecutor):
    """datatrove's Slurm executor without the options the spec leaves unset (no `--partition=None`) and without
    its separate stats-merging job: the driver merges the ranks' statistics itself, and a merge job that depends on
    a failed array would wait in the queue forever."""

    def get_sbatch_args(self, max_array: int = 1) -> dict:
        return {key: value for key, value in super().get_sbatch_args(max_array).items() if value is not None}

    def launch_merge_stats(self) -> None:
        return None
