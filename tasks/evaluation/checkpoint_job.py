"""One checkpoint's scheduled or event-triggered evaluation (flows/scheduled_eval.py), computed where the spec's
evaluation phase is placed (tasks/steps/placement.py; its backend's `run_whole`): in the calling process on the
spec's device and precision or, under a cluster, as a Slurm job of the evaluation phase's shape (`python -m
compass.tasks.evaluation.checkpoint_job JOB.json`, the job file in a work folder on the shared root), exactly as the
run's own evaluate step is placed. The orchestrating worker then loads no model: it submits, follows and reads the
result the job wrote.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict

from compass.infra.fingerprint import sha256_file
from compass.infra.layout import WEIGHTS, pending_copy
from compass.infra.store import Store
from compass.specs.evaluation import Benchmark
from compass.specs.how import How
from compass.tasks.common.devices import device_for
from compass.tasks.evaluation.lighteval_run import run_lighteval
from compass.tasks.steps.backends import WholeWork, launcher_for
from compass.tasks.steps.placement import HERE, place_phase

MODULE = "compass.tasks.evaluation.checkpoint_job"
JOB_FILE = "checkpoint-evaluation.json"


class CheckpointEvaluation(BaseModel):
    """What one evaluation reads: where the checkpoint is (`copy`: a training step's work folder, else the committed
    `artifact` and its `folder`), the suite, and where its result goes."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    store_root: str
    checkpoint: dict[str, Any]  # the checkpoint as the flow's parameters and results carry it
    benchmarks: list[Benchmark]
    suite: str
    target: str  # the result's path in the store: written once, never half-visible
    how: How | None = None  # the spec's: device, precision, kernels (None: this process's CPU in fp32)


def evaluate(job: CheckpointEvaluation, log: logging.Logger | logging.LoggerAdapter) -> dict[str, Any]:
    """The result record, computed where the spec's evaluation phase is placed: here, or by a Slurm job of its shape
    (its work folder on the cluster's shared root)."""
    how = job.how or How()
    placement = place_phase("evaluation", how) if job.how else HERE
    store = Store(job.store_root, how.orchestration.shared_root)
    sha = job.checkpoint["weights_sha256"]
    work = store.work_dir("evaluations", job.suite[:12], sha)

    def collect() -> dict[str, Any]:
        with store.fs.open(job.target) as f:
            record = json.load(f)
        shutil.rmtree(work, ignore_errors=True)
        return record

    return launcher_for(placement).run_whole(WholeWork(
        what=f"the evaluation of {job.checkpoint.get('folder')} ({job.target})", label=f"evaluate-{sha[:12]}",
        workdir=work, module=MODULE, job_file=work / JOB_FILE, job_text=lambda inside: job.model_dump_json(indent=1),
        compute=lambda: score(job), done=lambda: store.fs.exists(job.target), collect=collect), how, log)


def score(job: CheckpointEvaluation) -> dict[str, Any]:
    """Evaluate the checkpoint in this process and write its record to `job.target`."""

    store = Store(job.store_root)
    where = device_for(job.how) if job.how else None
    with tempfile.TemporaryDirectory(prefix="compass-eval-") as scratch:
        local = _local_copy(store, job.checkpoint, Path(scratch))
        started = time.time()
        scores = run_lighteval(local, job.benchmarks, Path(scratch), where, job.how)
    metrics = {f"{name}/{m}": v for name, values in scores.results.items() for m, v in values.items()
               if not m.endswith("_stderr")}
    record = {"checkpoint": job.checkpoint, "suite": job.suite,
              "benchmarks": [b.model_dump(mode="json") for b in job.benchmarks], "metrics": metrics,
              "provenance": scores.provenance, "seconds": time.time() - started,
              "device": where.device if where else "cpu", "dtype": where.dtype if where else "float32",
              "slurm_job": os.environ.get("SLURM_JOB_ID")}  # which job computed it, under a cluster
    if store.is_remote:
        with store.fs.open(job.target, "w") as f:  # a single PUT: never half-visible
            f.write(json.dumps(record, indent=2))
    else:
        target = Path(job.target)
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_suffix(".tmp")
        tmp.write_text(json.dumps(record, indent=2))
        tmp.rename(target)
    return record


def _local_copy(store: Store, checkpoint: dict[str, Any], scratch: Path) -> Path:
    """The checkpoint's Hugging Face folder on local disk. One in a training step's work folder is copied and
    checked against the weights' sha256 (the step removes the folder once it commits; keep_last moves a pruned
    export to evaluation-pending/ meanwhile); otherwise the committed artifact holding it is read."""
    if checkpoint.get("copy"):
        local = scratch / "model"
        for path in (Path(checkpoint["copy"]), pending_copy(Path(checkpoint["copy"]))):
            shutil.rmtree(local, ignore_errors=True)
            try:
                shutil.copytree(path, local)
                if sha256_file(str(local / WEIGHTS)) == checkpoint["weights_sha256"]:
                    return local
            except (OSError, shutil.Error):
                pass
        if not checkpoint.get("artifact"):
            raise FileNotFoundError(f"{checkpoint['copy']} went away; the flow locates the committed artifact "
                                    "holding its weights on its next attempt")
    return store.local_path(checkpoint["artifact"], only=checkpoint["folder"]) / checkpoint["folder"]


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    job = CheckpointEvaluation.model_validate_json(Path(args[0]).read_text())
    record = score(job)
    logging.getLogger("compass").info("evaluated %s %s: %s", job.checkpoint.get("step"), job.checkpoint.get("folder"),
                                      ", ".join(f"{k} {v:.4g}" for k, v in sorted(record["metrics"].items())
                                                if isinstance(v, int | float)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
