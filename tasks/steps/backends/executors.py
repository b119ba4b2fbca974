"""datatrove's executors as compass runs them: a module of its own because Slurm array tasks and local workers
unpickle the executor, and its class must be importable there.

Both record why a rank failed (the exception itself, pickled into the stage's logging folder), so the step fails
with the real error (a broken record named with its file and line) rather than "rank 3 did not complete", wherever
the rank ran. The local executor also lets the other ranks finish: a relaunch then redoes only the failed ones.
"""

from __future__ import annotations

import os
import pickle
import tempfile

from datatrove.executor import LocalPipelineExecutor, SlurmPipelineExecutor
from datatrove.utils.stats import PipelineStats

FAILURES = "failures"


class RecordsFailures:
    """Mixin: a rank's exception is written to `<logging_dir>/failures/<rank>.pickle` before it propagates."""

    logging_dir: object

    def _record_failure(self, rank: int, exc: BaseException) -> None:
        try:
            data = pickle.dumps(exc)
        except Exception:  # an exception that does not pickle: its text is enough
            data = pickle.dumps(RuntimeError(f"{type(exc).__name__}: {exc}"))
        with self.logging_dir.open(f"{FAILURES}/{rank:05d}.pickle", "wb") as f:
            f.write(data)


class LocalExecutor(RecordsFailures, LocalPipelineExecutor):
    """datatrove's local executor whose failed ranks do not stop the others (its pool ends at the first failure
    and kills the ranks still running, which a relaunch would then redo). Its ranks see the environment of the
    step that runs them: multiprocess's forkserver lives as long as the process that started it and forks
    workers with the environment it had then (credentials set since, an S3 endpoint, would be missing)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.environment = dict(os.environ)
        self.launcher = os.getpid()

    def _run_for_rank(self, rank: int, local_rank: int = 0, node_rank: int = -1) -> PipelineStats:
        if os.getpid() != self.launcher:  # a worker; ranks run in the launcher (one worker) already see its env
            os.environ.update(self.environment)
            tempfile.tempdir = None  # the step's TMPDIR, not the one the forkserver found (rank-local files)
        try:
            return super()._run_for_rank(rank, local_rank, node_rank)
        except Exception as exc:
            self._record_failure(rank, exc)
            return PipelineStats()


class ArrayExecutor(RecordsFailures, SlurmPipelineExecutor):
    """datatrove's Slurm executor without the options the spec leaves unset (no `--partition=None`) and without
    its separate stats-merging job: the driver merges the ranks' statistics itself, and a merge job that depends on
    a failed array would wait in the queue forever."""

    def get_sbatch_args(self, max_array: int = 1) -> dict:
        return {key: value for key, value in super().get_sbatch_args(max_array).items() if value is not None}

    def launch_merge_stats(self) -> None:
        return None

    def _run_for_rank(self, rank: int, local_rank: int = 0, node_rank: int = -1) -> PipelineStats:
        try:
            return super()._run_for_rank(rank, local_rank, node_rank)
        except Exception as exc:
            self._record_failure(rank, exc)
            raise


class JobIds:
    """datatrove's job id retriever, keeping every id: a stage of several arrays launched together has several
    (datatrove's executor keeps only the last). Here because the executor, pickled with it, is unpickled by every
    array task."""

    def __init__(self) -> None:
        self.ids: list[str] = []

    def __call__(self, sbatch_output: str) -> str:
        job_id = sbatch_output.split()[-1]
        self.ids.append(job_id)
        return job_id


def rank_failure(logging_dir, rank: int) -> BaseException | None:
    """The exception rank `rank` recorded when it last failed (None when it recorded none)."""
    path = logging_dir / FAILURES / f"{rank:05d}.pickle"
    try:
        return pickle.loads(path.read_bytes())
    except FileNotFoundError:
        return None
    except Exception as exc:  # a class that no longer unpickles
        return RuntimeError(f"rank {rank} failed; its recorded error did not load ({exc})")
