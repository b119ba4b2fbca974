"""A whole step inside a Slurm job: `python -m compass.tasks.steps.step_job STEP.json` rebuilds the step's run from
the file the orchestrator wrote in its work folder (on the cluster's shared root), computes it on the job's nodes
and commits it to the store like a step run in-process (tasks/steps/execution.py). What the step reported is left
in the work folder for the orchestrator (it shows it in the UI); the orchestrator never computes.

When the job is asked to stop before its time limit (the trainer checkpointed), this exits without committing and
the batch shell requeues the job; the requeued job resumes from the checkpoint.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import logging
import sys
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict

from compass.infra.disk_full import FullDisk, clear_full_disk_notes, note_full_disk
from compass.infra.errors import DiskFull, StopRequested
from compass.infra.exits import RETRIABLE_EXIT, RetriableRanksFailure
from compass.infra.layout import WorkFolder
from compass.infra.store import Store
from compass.specs.how import How
from compass.tasks.steps.context import InputArtifact, Runtime, StepResult
from compass.tasks.steps.execution import StepRun, execute
from compass.tasks.steps.placement import Placement

MODULE = "compass.tasks.steps.step_job"
log = logging.getLogger("compass")


class JobInput(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    step_id: str
    uri: str


class StepJob(BaseModel):
    """A step's run as the job reads it: its typed config (class and JSON), its inputs' URIs, where to commit."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: str
    name: str
    config_type: str  # module:class: a kind's configs may be several classes (post_train: sft, dpo, ...)
    config: dict[str, Any]
    fingerprint: str
    uri: str
    inputs: dict[str, JobInput]
    workdir: Path
    work_key: str
    how: How
    base_dir: Path
    run: str
    placement: Placement  # the step's placement as the job sees it (in_slurm_job, its shape)
    store_root: str
    scratch_root: Path | None
    spec_hash: str
    spec_name: str

    @classmethod
    def of(cls, run: StepRun, placement: Placement) -> StepJob:
        """The job file of `run`, for a job that sees `placement` (in_slurm_job, the step's shape)."""
        config_type = f"{type(run.config).__module__}:{type(run.config).__qualname__}"
        return cls(kind=run.kind, name=run.name, config_type=config_type, config=run.config.model_dump(mode="json"),
                   fingerprint=run.fingerprint, uri=run.uri,
                   inputs={role: JobInput(step_id=a.step_id, uri=a.uri) for role, a in run.inputs.items()},
                   workdir=run.workdir, work_key=run.work_key, how=run.runtime.how, base_dir=run.runtime.base_dir,
                   run=run.runtime.run, placement=placement, store_root=run.store.root,
                   scratch_root=run.store.scratch_root, spec_hash=run.spec_hash, spec_name=run.spec_name)

    def step_run(self) -> StepRun:
        module, _, name = self.config_type.partition(":")
        config_class = getattr(importlib.import_module(module), name)
        store = Store(self.store_root, self.scratch_root)
        inputs = {role: InputArtifact(role, i.step_id, i.uri, store.read_manifest(i.uri), store)
                  for role, i in self.inputs.items()}
        runtime = Runtime(how=self.how, base_dir=self.base_dir, run=self.run, placement=self.placement)
        return StepRun(kind=self.kind, name=self.name, config=config_class.model_validate(self.config),
                       fingerprint=self.fingerprint, uri=self.uri, inputs=inputs, store=store, workdir=self.workdir,
                       work_key=self.work_key, runtime=runtime, spec_hash=self.spec_hash, spec_name=self.spec_name)


def write_result(workdir: Path, result: StepResult) -> None:
    path = WorkFolder(workdir).step_result
    path.write_text(json.dumps(dataclasses.asdict(result), default=str))


def read_result(workdir: Path) -> StepResult | None:
    """What the job's step reported; None when its work folder is gone (another orchestrator cleaned it up)."""
    try:
        return StepResult(**json.loads(WorkFolder(workdir).step_result.read_text()))
    except FileNotFoundError:
        return None


def main(argv: list[str] | None = None) -> int:

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    job = StepJob.model_validate_json(Path((argv if argv is not None else sys.argv[1:])[0]).read_text())
    run = job.step_run()
    if run.store.is_committed(run.uri):  # a requeued job whose step committed before its stop
        log.info("%s is committed at %s", run.step_id, run.uri)
        return 0
    clear_full_disk_notes(run.workdir)
    try:
        _, result = execute(run, log)
    except DiskFull as full:  # the orchestrator raises it too (flows/runner.py), from this note or the disk
        log.error("%s", full)
        note_full_disk(run.workdir, "step", FullDisk(full.errno, None))
        return 1
    except StopRequested as stopped:
        log.warning("%s: %s; the requeued job resumes from the checkpoint", run.step_id, stopped)
        return 0
    except RetriableRanksFailure as failed:
        log.error("%s: %s", run.step_id, failed)
        return RETRIABLE_EXIT  # the batch shell requeues the job under its budget
    write_result(run.workdir, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
