"""lighteval on the evaluate step's ranks: with `how.resources.evaluation` giving several devices (and
`how.generation` left to transformers), every rank runs lighteval's Pipeline under its accelerate launcher, which
splits each task's samples over the ranks and gathers the scores on rank 0; the results are those of one process,
on N times the devices. The ranks are started like a TRL step's (torchrun here, srun in the step's Slurm job):
`python -m compass.tasks.evaluation.lighteval_ranks JOB`."""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict

from compass.infra.die_with_parent import die_with_parent
from compass.infra.environment import prepare_environment
from compass.infra.exits import broken_collective, failed_device
from compass.specs.evaluation import Benchmark
from compass.specs.how import How, Shape
from compass.tasks.common.devices import Device
from compass.tasks.evaluation.lighteval_run import run_lighteval
from compass.tasks.evaluation.scores import BenchmarkScores

MODULE = "compass.tasks.evaluation.lighteval_ranks"


class LightevalJob(BaseModel):
    """What every rank is handed; rank 0 writes the scores and the benchmarks' provenance to `result`."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model_dir: Path
    tasks: list[Benchmark]
    folder: Path  # the job's folder on the shared root: each rank's scratch below it
    device: str
    bf16: bool
    how: How

    @property
    def result(self) -> Path:
        return self.folder / "lighteval-result.json"

    def write(self) -> Path:
        self.folder.mkdir(parents=True, exist_ok=True)
        path = self.folder / "lighteval-job.json"
        path.write_text(self.model_dump_json(indent=1))
        return path


def lighteval_on_ranks(model_dir: Path, tasks: list[Benchmark], folder: Path, where: Device, how: How, shape: Shape,
                       runtime: Any, log: logging.Logger) -> BenchmarkScores:
    """lighteval run data-parallel over the shape's ranks: the scores `run_lighteval` gives, from rank 0."""
    from compass.tasks.common.training import run_module_ranks

    job = LightevalJob(model_dir=model_dir, tasks=tasks, folder=folder, device=where.device, bf16=where.bf16, how=how)
    job.result.unlink(missing_ok=True)
    run_module_ranks(MODULE, job.write(), shape.ranks, shape, runtime, log)
    return BenchmarkScores.model_validate_json(job.result.read_text())


def main(job_path: str) -> int:
    """One lighteval rank; its exit code: RETRIABLE_EXIT when a collective broke (a peer lost), so the step's
    Slurm job requeues itself."""
    from compass.model.training import collectives

    die_with_parent(never_a_child_of_init=True)
    prepare_environment()
    job = LightevalJob.model_validate_json(Path(job_path).read_text())
    rank = collectives.rank_env()[0]
    scratch = job.folder / f"rank{rank}"
    scratch.mkdir(parents=True, exist_ok=True)
    try:
        scores = run_lighteval(job.model_dir, job.tasks, scratch, Device(job.device, job.bf16), job.how,
                               data_parallel=True)
    except Exception as failed:
        if collectives.broke_a_collective(failed):  # a peer lost or a collective broken (NCCL, gloo): retriable
            return broken_collective(Path(job_path).parent, rank, failed)
        if (code := failed_device(Path(job_path).parent, rank, failed)) is not None:  # ECC, Xid, NVLink: retriable
            return code
        raise
    if rank == 0:
        tmp = job.result.with_suffix(".tmp")
        tmp.write_text(scores.model_dump_json())
        tmp.replace(job.result)
    collectives.leave()
    return 0


if __name__ == "__main__":
    from compass.model.training import collectives

    collectives.exit_process(main(sys.argv[1]))
