"""Scheduled evaluation: a Prefect flow that scans a checkpoint root (local or s3://) and evaluates exactly
the checkpoints that have no result for the current suite yet.

Checkpoints are found through committed manifests only (an artifact's manifest is written last), so a
checkpoint still being written is invisible until its step commits, and is picked up by the next run. A
checkpoint is identified by the sha256 of its weights, and a suite by the hash of its definition, so a
result is never computed twice and a changed suite evaluates everything again.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger, task
from prefect.artifacts import create_table_artifact
from prefect.cache_policies import NO_CACHE
from prefect.client.schemas.objects import ConcurrencyLimitConfig, ConcurrencyLimitStrategy

from compass.flows.server.confinement import store_outside_worker
from compass.infra.credentials import apply_credentials_block
from compass.infra.environment import prepare_environment
from compass.infra.layout import WEIGHTS, ModelArtifact, pending_copy
from compass.infra.locks import step_lock
from compass.infra.store import Store
from compass.specs.evaluation import Benchmark
from compass.specs.how import How
from compass.tasks.evaluation.live_results import result_path as weights_result_path
from compass.tasks.evaluation.live_results import suite_hash as versioned_suite_hash
from compass.tasks.steps import registry

# Evaluations started by checkpoint events wait their turn: each holds a device while it runs.
ONE_EVALUATION_AT_A_TIME = ConcurrencyLimitConfig(limit=1, collision_strategy=ConcurrencyLimitStrategy.ENQUEUE)
# A scan still running when the schedule fires again makes the new run cancel itself: overlapping scans would
# only wait on each other's locks, and one run per tick that finds nothing new is the expected rhythm.
SCAN_ONE_AT_A_TIME = ConcurrencyLimitConfig(limit=1, collision_strategy=ConcurrencyLimitStrategy.CANCEL_NEW)


def discover(store: Store) -> list[dict[str, Any]]:
    """Every Hugging Face checkpoint inside committed model artifacts, with the sha256 of its weights."""
    found = []
    for kind in registry.model_kinds():
        for manifest in store.committed(kind):  # through the store's checks: a damaged manifest is none
            for entry in manifest.files:
                if ModelArtifact.holds_weights(entry.path):
                    folder = entry.path.rsplit("/", 1)[0]
                    found.append({"artifact": manifest.uri, "folder": folder, "step": manifest.step_id,
                                  "weights_sha256": entry.sha256,
                                  "tokens": manifest.metrics.get("tokens")})
    return sorted(found, key=lambda c: (c["artifact"], c["folder"]))


def suite_hash(benchmarks: list[dict[str, Any]]) -> str:
    return versioned_suite_hash(benchmarks, registry.kind("evaluate").version)


def result_path(store: Store, suite: str, checkpoint: dict[str, Any]) -> str:
    return weights_result_path(store, suite, checkpoint["weights_sha256"])


@task(cache_policy=NO_CACHE, persist_result=False, task_run_name="evaluate {checkpoint[step]} {checkpoint[folder]}")
def evaluate_checkpoint(store_root: str, checkpoint: dict[str, Any], benchmarks: list[dict[str, Any]],
                        suite: str, how: dict[str, Any] | None = None) -> dict[str, Any] | None:
    """Evaluate one checkpoint unless a result exists (or appears while waiting for another run's lock): here, or
    as a Slurm job of the evaluation phase's shape when the spec (`how`) has a cluster."""
    from compass.tasks.evaluation.checkpoint_job import CheckpointEvaluation, evaluate

    spec_how = How.model_validate(how) if how else None
    store = Store(store_root)
    target = result_path(store, suite, checkpoint)
    key = f"evaluations/{suite[:12]}/{checkpoint['weights_sha256'][:20]}"
    with step_lock(store, key, should_stop=lambda: store.fs.exists(target)) as held:
        if not held or store.fs.exists(target):  # an overlapping run evaluated it first
            return None
        job = CheckpointEvaluation(store_root=store_root, checkpoint=checkpoint, suite=suite, target=target,
                                   benchmarks=[Benchmark.model_validate(b) for b in benchmarks], how=spec_how)
        log = get_run_logger()
        try:
            return evaluate(job, log)
        except Exception:
            if not checkpoint.get("copy"):
                raise
            # the training step committed and removed its work folder meanwhile: the committed artifact holds it
            committed = next((c for c in discover(store) if c["weights_sha256"] == checkpoint["weights_sha256"]),
                             None)
            if committed is None:
                raise
            log.info("%s moved into its committed artifact: evaluating it there", checkpoint["copy"])
            return evaluate(job.model_copy(update={"checkpoint": committed | {"tokens": checkpoint.get("tokens")}}),
                            log)


# log_prints off, as in the lifecycle: a library's print (dill disassembling a function into a stdout it captures)
# is not an INFO line of the run
@flow(name="compass-scheduled-evaluation", persist_result=False, log_prints=False)
def evaluate_new_checkpoints(checkpoint_root: str, benchmarks: list[dict[str, Any]],
                             credentials_block: str | None = None,
                             how: dict[str, Any] | None = None) -> dict[str, Any]:
    """Evaluate every committed checkpoint under `checkpoint_root` that has no result for this suite."""

    prepare_environment()
    apply_credentials_block(credentials_block)
    logger = get_run_logger()
    store = Store(checkpoint_root)
    suite = suite_hash(benchmarks)
    checkpoints = list({c["weights_sha256"]: c for c in reversed(discover(store))}.values())  # same weights once
    todo = [c for c in checkpoints if not store.fs.exists(result_path(store, suite, c))]
    logger.info("%d checkpoints under %s, %d without results for suite %s", len(checkpoints), checkpoint_root,
                len(todo), suite[:12])
    records = [r for c in todo if (r := evaluate_checkpoint(checkpoint_root, c, benchmarks, suite, how)) is not None]
    if records:
        create_table_artifact(key=f"scheduled-evaluation-{suite[:12]}", description=f"suite {suite[:12]}",
                              table=[{"step": r["checkpoint"]["step"], "checkpoint": r["checkpoint"]["folder"],
                                      **{k: round(v, 4) for k, v in r["metrics"].items()}} for r in records])
    summary = {"suite": suite, "checkpoints": len(checkpoints), "evaluated": [r["checkpoint"] for r in records],
               "scores": [{"step": r["checkpoint"]["step"], "checkpoint": r["checkpoint"]["folder"],
                           "metrics": {k: v for k, v in r["metrics"].items() if isinstance(v, int | float)}}
                          for r in records]}
    runs = f"{store.root_path}/.evaluations/{suite[:12]}/runs"
    if not store.is_remote:
        Path(runs).mkdir(parents=True, exist_ok=True)
    with store.fs.open(f"{runs}/{int(time.time() * 1000)}.json", "w") as f:
        f.write(json.dumps(summary))
    return summary


def scan_lines(summary: dict[str, Any]) -> list[str]:
    """A scan as a terminal shows it: how many checkpoints, then each one evaluated now with its scores."""
    lines = [f"{summary['checkpoints']} checkpoints, {len(summary['scores'])} evaluated now "
             f"(suite {summary['suite'][:12]})"]
    for s in summary["scores"]:
        shown = ", ".join(f"{k} {v:.4g}" for k, v in sorted(s["metrics"].items()))
        lines.append(f"  {s['step']} {s['checkpoint']}: {shown}")
    return lines


def locate(store: Store, checkpoint: dict[str, Any]) -> dict[str, Any] | None:
    """Where to read a checkpoint an event named: its work folder while the training step runs, else the committed
    artifact holding the same weights (the step removes its work folder once it commits); None once pruned."""
    path = Path(checkpoint.get("path") or "")
    for where in (path, pending_copy(path)) if path.name else ():
        if where.is_dir() and (where / WEIGHTS).exists():
            return {**checkpoint, "copy": str(where)}
    return next((c | {"tokens": c.get("tokens") or checkpoint.get("tokens")} for c in discover(store)
                 if c["weights_sha256"] == checkpoint["weights_sha256"]), None)


@flow(name="compass-checkpoint-evaluation", persist_result=False, log_prints=False)
def evaluate_committed_checkpoint(checkpoint: dict[str, Any], benchmarks: list[dict[str, Any]], store_root: str,
                                  credentials_block: str | None = None,
                                  how: dict[str, Any] | None = None) -> dict[str, Any]:
    """Evaluate the checkpoint a `compass.checkpoint.committed` event names (compass deploy's automation runs this
    for each one, with the store of the run that committed it). Results go where the scheduled evaluation keeps
    them, keyed by the weights: neither this flow nor the schedule evaluates the same weights twice for one suite,
    and the run's own evaluate step takes a kept checkpoint's benchmark scores from here (live_results)."""

    prepare_environment()
    apply_credentials_block(credentials_block)
    logger = get_run_logger()
    name = f"{checkpoint.get('step')} {checkpoint.get('folder')}"
    if refused := store_outside_worker(store_root):  # the event names the run's store: within this worker's limits
        logger.error("%s: not evaluated: store %s", name, refused)
        return {"suite": None, "evaluated": None, "checkpoint": checkpoint}
    store = Store(store_root)
    suite = suite_hash(benchmarks)
    if store.fs.exists(result_path(store, suite, checkpoint)):
        logger.info("%s: already evaluated for suite %s", name, suite[:12])
        return {"suite": suite, "evaluated": None, "checkpoint": checkpoint}
    located = locate(store, checkpoint)
    if located is None:
        logger.warning("%s: its weights are no longer in the work folder or any committed artifact (pruned by "
                       "how.checkpoints.keep_last); nothing to evaluate", name)
        return {"suite": suite, "evaluated": None, "checkpoint": checkpoint}
    record = evaluate_checkpoint(store_root, located, benchmarks, suite, how)
    if record is not None:
        create_table_artifact(key=f"checkpoint-evaluation-{checkpoint['weights_sha256'][:12]}",
                              description=f"{name}, suite {suite[:12]}",
                              table=[{"step": checkpoint.get("step"), "checkpoint": checkpoint.get("folder"),
                                      "tokens": checkpoint.get("tokens"),
                                      **{k: round(v, 4) for k, v in record["metrics"].items()}}])
    return {"suite": suite, "evaluated": record["checkpoint"] if record else None, "checkpoint": checkpoint}
