"""Run one Step against the store: skip when committed, lock, verify the inputs, then hand it whole to the backend
of its placement (tasks/steps/backends/): computed here, or by a Slurm job that commits it on the cluster.

Plain Python (no Prefect), so the Prefect task stays a thin wrapper and the logic tests without a server.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, replace

from compass.flows.compiler import Plan
from compass.infra import verify
from compass.infra.errors import DamagedArtifact, RunStopped
from compass.infra.layout import WorkFolder
from compass.infra.locks import step_lock
from compass.infra.manifest import Manifest
from compass.infra.store import Store, artifact_folder
from compass.tasks.steps import registry
from compass.tasks.steps.backends import WholeWork, launcher_for, stale_work
from compass.tasks.steps.context import InputArtifact, Runtime, StepResult
from compass.tasks.steps.execution import SUMMARY_FILE, StepRun, clear_work, execute
from compass.tasks.steps.kind import Step
from compass.tasks.steps.placement import Placement, place
from compass.tasks.steps.step_job import MODULE as STEP_JOB_MODULE
from compass.tasks.steps.step_job import StepJob, read_result

__all__ = ["SUMMARY_FILE", "RunContext", "StepOutcome", "run_in_process", "run_step", "step_uri"]


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


def step_uri(ctx: RunContext, step: Step) -> str:
    return ctx.store.uri(step.kind, step.name, ctx.plan.fingerprints[step.id])


def placement_of(ctx: RunContext, step: Step) -> Placement:
    return place(registry.kind(step.kind), step.config, ctx.runtime.how)


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
    fingerprint = ctx.plan.fingerprints[step.id]
    if store.is_committed(uri):
        damaged = verify.damage(store, uri, storage.verify, expects=fingerprint)
        if not damaged:
            log.info("%s is cached at %s", step.id, uri)
            _sweep_finished_work(ctx, step)
            return StepOutcome(step.id, uri, False, store.read_manifest(uri))
        if storage.on_damage == "stop":
            raise DamagedArtifact(
                f"{step.id}: {uri} was altered after its commit ({verify.describe(damaged)}); left in place for "
                "inspection. `compass verify STORE --set-aside` moves it aside, or run without --no-recompute "
                "to recompute it")
        where = verify.set_aside(store, uri)
        log.warning("%s at %s was altered after its commit (%s): set aside at %s; running it again", step.id,
                    uri, verify.describe(damaged), where)
    key = artifact_folder(step.kind, step.name, fingerprint)

    def waiting(holder: dict) -> None:
        job = f", Slurm job {holder['job']}" if holder.get("job") else ""
        log.info("%s is being computed by another run (%s pid %s%s): waiting for it", step.id, holder.get("host"),
                 holder.get("pid"), job)

    def taken_over(holder: dict | None) -> None:
        who = f"{holder.get('host')} pid {holder.get('pid')}" if holder else "a crashed run"
        log.info("%s: took over the lock of %s (its process is gone)", step.id, who)

    with step_lock(store, key, should_stop=lambda: store.is_committed(uri), on_wait=waiting,
                   on_take_over=taken_over) as lock:
        if lock is None or store.is_committed(uri):  # another run committed it while we waited
            log.info("%s was committed by another run", step.id)
            return StepOutcome(step.id, uri, False, store.read_manifest(uri))
        placement = placement_of(ctx, step)
        run = StepRun(kind=step.kind, name=step.name, config=step.config, fingerprint=fingerprint, uri=uri,
                      inputs=_inputs(ctx, step), store=store,
                      workdir=store.work_dir(step.kind, step.name, fingerprint), work_key=key,
                      runtime=replace(ctx.runtime, placement=placement), spec_hash=ctx.spec_hash,
                      spec_name=ctx.plan.spec_name)
        manifest, result = launcher_for(placement).run_whole(_whole_step(run, log, lock.annotate), run.runtime.how,
                                                             log)
        clear_work(store, key, run.workdir)
        return StepOutcome(step.id, uri, True, manifest, result)


def _inputs(ctx: RunContext, step: Step) -> dict[str, InputArtifact]:
    """The step's committed inputs, each checked against its manifest first."""
    store, storage = ctx.store, ctx.runtime.how.storage
    inputs = {}
    for role, dep_id in step.inputs.items():
        dep = ctx.plan.step(dep_id)
        dep_uri = step_uri(ctx, dep)
        if not store.is_committed(dep_uri):
            raise RuntimeError(f"{step.id} needs {dep_id}, which is not committed at {dep_uri}")
        damaged = verify.damage(store, dep_uri, storage.verify,  # stat only, unless files changed
                                expects=ctx.plan.fingerprints[dep_id])
        if damaged:
            where = "" if storage.on_damage == "stop" else f"; set aside at {verify.set_aside(store, dep_uri)}"
            raise DamagedArtifact(
                f"{step.id}: its input {dep_id} at {dep_uri} was altered after its commit "
                f"({verify.describe(damaged)}){where}; run again to recompute it")
        inputs[role] = InputArtifact(role, dep_id, dep_uri, store.read_manifest(dep_uri), store)
    return inputs


def _whole_step(run: StepRun, log: logging.Logger | logging.LoggerAdapter,
                annotate: Callable[..., None]) -> WholeWork[tuple[Manifest, StepResult | None]]:
    """The step as its backend runs it: computed and committed here, or by a job of its shape that rebuilds the run
    from its job file (tasks/steps/step_job.py) and commits it; the job's id goes into the step's lock."""
    work = WorkFolder(run.workdir)
    return WholeWork(
        what=run.step_id, label=f"{run.kind}-{run.name}", workdir=run.workdir, module=STEP_JOB_MODULE,
        job_file=work.step_job, job_text=lambda inside: StepJob.of(run, inside).model_dump_json(indent=1),
        compute=lambda: execute(run, log), done=lambda: run.store.is_committed(run.uri),
        collect=lambda: (run.store.read_manifest(run.uri), read_result(run.workdir)),
        on_job=lambda job: annotate(job=job))


def _sweep_finished_work(ctx: RunContext, step: Step) -> None:
    """A committed step's work folder that its orchestrator never removed (it died while the step's job finished):
    removed now, unless a job is still at work in it."""
    fingerprint = ctx.plan.fingerprints[step.id]
    workdir = ctx.store.work_dir(step.kind, step.name, fingerprint)
    if stale_work(workdir):
        clear_work(ctx.store, artifact_folder(step.kind, step.name, fingerprint), workdir)


def run_in_process(plan: Plan, store: Store, spec_hash: str, runtime: Runtime,
                   log: logging.Logger | logging.LoggerAdapter | None = None) -> dict[str, StepOutcome]:
    """Every step of `plan`, one after another from this process, without Prefect: for tests, benchmarks and
    debugging a step. The same store, locks, caching, placement and manifests as a flow run."""
    ctx = RunContext(plan, store, spec_hash, runtime)
    log = log or logging.getLogger("compass")
    return {step.id: run_step(ctx, step, log) for step in plan.steps}
