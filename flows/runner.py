"""Run one Step against the store: skip when committed, lock, stage, execute, commit with lineage.

Plain Python (no Prefect), so the Prefect task stays a thin wrapper and the logic tests without a server.
"""

from __future__ import annotations

import errno
import logging
import shutil
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from compass.flows.compiler import Plan
from compass.infra import verify
from compass.infra.errors import DamagedArtifact, DiskFull, RunStopped
from compass.infra.locks import step_lock
from compass.infra.manifest import InputRef, Manifest, code_version, host_facts, library_versions
from compass.infra.store import Store, artifact_folder, owned_prefix
from compass.tasks.steps import registry
from compass.tasks.steps.context import InputArtifact, Runtime, StepContext, StepResult
from compass.tasks.steps.kind import Step, StepKind

SUMMARY_FILE = "summary.md"


@dataclass
class StepOutcome:
    step_id: str
    uri: str
    executed: bool
    manifest: Manifest
    result: StepResult | None = None


@dataclass(frozen=True)
class RunContext:
    plan: Plan
    store: Store
    spec_hash: str
    runtime: Runtime


@contextmanager
def _default_grad_mode() -> Iterator[None]:
    """Steps run on reused worker threads, and torch's grad mode is per thread: a library that switches it off
    and never back (lighteval does) would leave the next step on that thread unable to train."""
    import torch

    with torch.enable_grad():
        yield


@contextmanager
def _disk_full_named(step_id: str, where: Path) -> Iterator[None]:
    try:
        yield
    except OSError as exc:
        if exc.errno != errno.ENOSPC:
            raise
        path = Path(exc.filename) if exc.filename else where
        probe = next((p for p in [path, *path.parents] if p.exists()), Path("/"))
        free = shutil.disk_usage(probe).free
        raise DiskFull(errno.ENOSPC, f"{step_id}: no space left on the device of {path} ({free / 2**20:,.0f} MiB "
                       "free there): free space, or move how.storage.root (and TMPDIR for S3 stores) to a larger "
                       "disk; the step resumes from its last checkpoint") from None


def _run_kind(kind: StepKind, sctx: StepContext) -> StepResult:
    """The kind's work, here or, for kinds that ask for it on a Slurm cluster, as a one-node job."""
    cluster = sctx.runtime.how.orchestration.cluster
    if cluster is not None and kind.whole_step_on_cluster:
        from compass.tasks.steps.step_job import run_on_cluster

        return run_on_cluster(sctx, cluster)
    return kind.run(sctx)


def step_uri(ctx: RunContext, step: Step) -> str:
    return ctx.store.uri(step.kind, step.name, ctx.plan.fingerprints[step.id])


def run_step(ctx: RunContext, step: Step, log: logging.Logger | logging.LoggerAdapter) -> StepOutcome:
    """Run one step (or find it committed); a kind that can stop the run (the gate) does so here, after its
    artifact is committed, so nothing after it starts."""
    outcome = _run_step(ctx, step, log)
    stops = registry.kind(step.kind).stops_run
    if stops is not None and (reason := stops(outcome.manifest.metrics)):
        raise RunStopped(f"{step.id}: {reason}")
    return outcome


def _run_step(ctx: RunContext, step: Step, log: logging.Logger | logging.LoggerAdapter) -> StepOutcome:
    store = ctx.store
    uri = step_uri(ctx, step)
    storage = ctx.runtime.how.storage
    if store.is_committed(uri):
        damaged = verify.damage(store, uri, storage.verify)
        if not damaged:
            log.info("%s is cached at %s", step.id, uri)
            return StepOutcome(step.id, uri, False, store.read_manifest(uri))
        if storage.on_damage == "stop":
            raise DamagedArtifact(
                f"{step.id}: {uri} was altered after its commit ({verify.describe(damaged)}); left in place for "
                "inspection. `compass verify STORE --set-aside` moves it aside, or run without --no-recompute "
                "to recompute it")
        where = verify.set_aside(store, uri)
        log.warning("%s at %s was altered after its commit (%s): set aside at %s; running it again", step.id,
                    uri, verify.describe(damaged), where)
    key = artifact_folder(step.kind, step.name, ctx.plan.fingerprints[step.id])
    kind = registry.kind(step.kind)
    def waiting(holder: dict) -> None:
        log.info("%s is being computed by another run (%s pid %s): waiting for it", step.id, holder.get("host"),
                 holder.get("pid"))

    def taken_over(holder: dict | None) -> None:
        who = f"{holder.get('host')} pid {holder.get('pid')}" if holder else "a crashed run"
        log.info("%s: took over the lock of %s (its process is gone)", step.id, who)

    with step_lock(store, key, should_stop=lambda: store.is_committed(uri), on_wait=waiting,
                   on_take_over=taken_over) as held:
        if not held or store.is_committed(uri):  # another run committed it while we waited
            log.info("%s was committed by another run", step.id)
            return StepOutcome(step.id, uri, False, store.read_manifest(uri))
        inputs = {}
        for role, dep_id in step.inputs.items():
            dep = ctx.plan.step(dep_id)
            dep_uri = step_uri(ctx, dep)
            if not store.is_committed(dep_uri):
                raise RuntimeError(f"{step.id} needs {dep_id}, which is not committed at {dep_uri}")
            damaged = verify.damage(store, dep_uri, storage.verify)  # stat only, unless files changed
            if damaged:
                where = "" if storage.on_damage == "stop" else f"; set aside at {verify.set_aside(store, dep_uri)}"
                raise DamagedArtifact(
                    f"{step.id}: its input {dep_id} at {dep_uri} was altered after its commit "
                    f"({verify.describe(damaged)}){where}; run again to recompute it")
            inputs[role] = InputArtifact(role, dep_id, dep_uri, store.read_manifest(dep_uri), store)
        started = time.time()
        log.info("%s running; commits to %s", step.id, uri)
        with store.staging() as out, \
                tempfile.TemporaryDirectory(prefix=owned_prefix("scratch"), dir=out.parent) as scratch:
            workdir = store.work_dir(step.kind, step.name, ctx.plan.fingerprints[step.id])
            sctx = StepContext(step.kind, step.name, step.config, inputs, out, Path(scratch), workdir, ctx.runtime,
                               log, store=store, work_key=key)
            with _default_grad_mode(), _disk_full_named(step.id, out):
                result = _run_kind(kind, sctx)
            if result.summary:  # kept with the artifact: a cached re-run shows it again in the UI
                (out / SUMMARY_FILE).write_text(result.summary)
            manifest = Manifest(
                kind=step.kind, name=step.name, fingerprint=ctx.plan.fingerprints[step.id], uri=uri,
                config=step.config.identity(),
                inputs=[InputRef(role=r, step=a.step_id, uri=a.uri, fingerprint=a.manifest.fingerprint)
                        for r, a in inputs.items()],
                spec_hash=ctx.spec_hash, spec_name=ctx.plan.spec_name, code_version=code_version(),
                phase_version=kind.version, libraries=library_versions(), **host_facts(),
                started_at=started, finished_at=time.time(), metrics=result.metrics,
                provenance=result.provenance,
            )
            with _disk_full_named(step.id, Path(store.root_path) if not store.is_remote else out):
                manifest = store.commit(out, manifest)
            verify.stamp(store, manifest)
        shutil.rmtree(workdir, ignore_errors=True)  # committed: checkpoints of the attempt are no longer needed
        if store.is_remote:
            from compass.infra.checkpoint_mirror import CheckpointMirror

            CheckpointMirror(store, key, workdir).clear()
        log.info("%s committed to %s in %.1fs", step.id, uri, manifest.duration_s)
        return StepOutcome(step.id, uri, True, manifest, result)


def run_in_process(plan: Plan, store: Store, spec_hash: str, runtime: Runtime,
                   log: logging.Logger | logging.LoggerAdapter | None = None) -> dict[str, StepOutcome]:
    """Every step of `plan`, one after another in this process, without Prefect: for tests, benchmarks and
    debugging a step. The same store, locks, caching and manifests as a flow run."""
    ctx = RunContext(plan, store, spec_hash, runtime)
    log = log or logging.getLogger("compass")
    return {step.id: run_step(ctx, step, log) for step in plan.steps}
