"""A whole step as a one-node Slurm job, for kinds that train or evaluate without compass's trainer (TRL
post-training, lighteval evaluation): the step's context is written as JSON, `python -m compass.tasks.steps.step_job
JOB.json` rebuilds it on the node and runs the kind there, and the step commits what the job wrote. The node
must see the step's staging and work folders at the same paths (a shared file system, as multi-node training
already assumes); for a store on S3 that means a shared TMPDIR.
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

from compass.infra.net import free_port
from compass.infra.slurm import JobShape, run_on_slurm
from compass.infra.store import Store
from compass.specs.how import How, SlurmCluster
from compass.tasks.steps import registry
from compass.tasks.steps.context import InputArtifact, Runtime, StepContext, StepResult

MODULE = "compass.tasks.steps.step_job"
log = logging.getLogger("compass")


class JobInput(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    step_id: str
    uri: str


class StepJob(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: str
    name: str
    config_type: str  # module:class: a kind's configs may be several classes (post_train: sft, dpo, ...)
    config: dict[str, Any]
    inputs: dict[str, JobInput]
    out: Path
    scratch: Path
    workdir: Path
    how: How  # without the cluster: inside the job the step runs where it is
    base_dir: Path
    store_root: str
    work_key: str
    run: str = "compass"


def run_on_cluster(ctx: StepContext, cluster: SlurmCluster) -> StepResult:
    """Submit the step as a one-node job and wait for it; its files are in ctx.out when it completed."""
    if ctx.store is None:
        raise ValueError(f"{ctx.kind}:{ctx.name}: a step runs on Slurm only with a store")
    how = ctx.runtime.how
    config_type = f"{type(ctx.config).__module__}:{type(ctx.config).__qualname__}"
    job = StepJob(kind=ctx.kind, name=ctx.name, config_type=config_type, config=ctx.config.model_dump(mode="json"),
                  inputs={role: JobInput(step_id=a.step_id, uri=a.uri) for role, a in ctx.inputs.items()},
                  out=ctx.out, scratch=ctx.scratch, workdir=ctx.workdir,
                  how=how.model_copy(update={"orchestration": how.orchestration.model_copy(update={"cluster": None})}),
                  base_dir=ctx.runtime.base_dir, store_root=ctx.store.root, work_key=ctx.work_key,
                  run=ctx.runtime.run)
    ctx.workdir.mkdir(parents=True, exist_ok=True)
    path = ctx.workdir / "step-job.json"
    path.write_text(job.model_dump_json(indent=1))
    hw = how.hardware
    shape = JobShape(ctx.workdir, path, 1, 1, hw.devices_per_node if hw.accelerator != "cpu" else None, MODULE)
    result = run_on_slurm(shape, cluster, sys.executable, label=f"{ctx.kind}-{ctx.name}"[:40], port=free_port(),
                          log=ctx.log)
    return StepResult(**result)


def run_job(path: Path) -> StepResult:
    job = StepJob.model_validate_json(path.read_text())
    kind = registry.kind(job.kind)
    kind.import_names()
    module, _, name = job.config_type.partition(":")
    config_class = getattr(importlib.import_module(module), name)
    store = Store(job.store_root)
    inputs = {role: InputArtifact(role, i.step_id, i.uri, store.read_manifest(i.uri), store)
              for role, i in job.inputs.items()}
    ctx = StepContext(job.kind, job.name, config_class.model_validate(job.config), inputs, job.out, job.scratch,
                      job.workdir, Runtime(how=job.how, base_dir=job.base_dir, run=job.run), log, store=store,
                      work_key=job.work_key)
    return kind.run(ctx)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    path = Path((argv if argv is not None else sys.argv[1:])[0])
    result = run_job(path)
    (path.parent / "result.json").write_text(json.dumps(dataclasses.asdict(result), default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
