"""The Prefect lifecycle flow: one task per Step, in dependency order, retries and timeouts from `how`,
a markdown/table artifact per step, and the plan published at the start of every run."""

from __future__ import annotations

import base64
import os
import queue
import re
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger, task
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.cache_policies import NO_CACHE
from prefect.exceptions import TerminationSignal
from prefect.futures import PrefectFuture
from prefect.runtime import deployment, flow_run
from prefect.task_runners import ThreadPoolTaskRunner

from compass.flows.compiler import Plan
from compass.flows.reports.mixture import consumption_section, source_sizes
from compass.flows.reports.plan_status import plan_status
from compass.flows.reports.plan_tables import cost_sections, dag_section, to_markdown
from compass.flows.reports.progress import run_progress
from compass.flows.reports.run_clock import RunClock, predicted_seconds
from compass.flows.reports.run_outcome import run_outcome
from compass.flows.reports.run_summary import RunSummary
from compass.flows.reports.smoke import smoke_table
from compass.flows.reports.step_record import StepRecord
from compass.flows.runner import SUMMARY_FILE, RunContext, StepOutcome, placement_of, run_step, step_uri
from compass.flows.server.confinement import (
    outside_roots,
    store_outside_worker,
    worker_roots,
    worker_store,
    writes_outside_worker,
)
from compass.flows.server.submit import ui_url
from compass.flows.validation import check, checked_already, shrunk
from compass.infra import resource_ledger
from compass.infra.credentials import apply_credentials_block
from compass.infra.errors import DataError, RootRefused
from compass.infra.interrupt import stop_run
from compass.infra.quiet_failures import quiet_data_errors
from compass.infra.run_records import end_dead_runs, run_record
from compass.infra.store import Store, root_problem
from compass.infra.temporary_server import temporary_server_running
from compass.model.training.rank_device import REHEARSAL_ENV
from compass.specs.how import Orchestration
from compass.specs.loader import SpecError, load_spec_text, parse_spec_text
from compass.specs.spec import TrainingSpec
from compass.tasks.steps import registry
from compass.tasks.steps.backends import launcher_for
from compass.tasks.steps.context import Runtime
from compass.tasks.steps.kind import GPU_TAG, Step


def artifact_key(*parts: str) -> str:
    """Prefect artifact keys allow lowercase letters, digits and dashes only."""
    return re.sub(r"-+", "-", re.sub(r"[^a-z0-9-]", "-", "-".join(parts).lower())).strip("-")[:100]


@task(cache_policy=NO_CACHE, persist_result=False)
def execute_step(ctx: RunContext, step: Step) -> StepRecord:
    log = get_run_logger()
    ledger, cpu = resource_ledger.Ledger(), resource_ledger.ThreadCpu()
    with resource_ledger.counting(ledger), _followed_live(ctx, step, log) as live:
        outcome = run_step(ctx, step, log)  # computed here, its manifest's resource ledger is this thread's
        if live is not None and outcome.executed:
            live.after_commit(outcome.uri, outcome.manifest)
        _publish(ctx, step, outcome)
    return StepRecord(step=step.id, uri=outcome.uri, executed=outcome.executed,
                      seconds=round(outcome.manifest.duration_s, 2), pid=os.getpid(),
                      orchestrator=ledger.snapshot().merged(resource_ledger.Resources(cpu_s=cpu.spent())))


def _followed_live(ctx: RunContext, step: Step, log: Any):
    """A training step's progress, loss plot and checkpoint events while it runs (flows/live.py)."""
    if not registry.kind(step.kind).trains:
        return nullcontext()
    from compass.flows.live import LiveTraining

    mon = ctx.runtime.how.monitoring
    workdir = ctx.store.work_dir(step.kind, step.name, ctx.plan.fingerprints[step.id])
    return LiveTraining(step, workdir, ctx.plan.spec_name, ctx.store.root, mon.progress_every_s,
                        mon.checkpoint_events, log, artifact_key(ctx.plan.spec_name, step.kind, step.name),
                        mon.plot_every_s)


def _publish(ctx: RunContext, step: Step, outcome: StepOutcome) -> None:
    m = outcome.manifest
    key = artifact_key(ctx.plan.spec_name, step.kind, step.name)
    head = outcome.result.summary if outcome.result else _cached_summary(ctx.store, step, m)
    inputs = "\n".join(f"- {i.role}: `{i.uri}`" for i in m.inputs) or "- none (raw source)"
    body = (f"{head}\n\n**output** `{m.uri}`  \n**fingerprint** `{m.fingerprint[:16]}`  \n"
            f"**took** {m.duration_s:.1f}s on {m.host}  \n**files** {m.file_count:,}, "
            f"{m.total_bytes:,} bytes\n\n**inputs**\n{inputs}\n{_embedded_plots(ctx.store, m)}")
    create_markdown_artifact(key=key, markdown=body, description=f"{step.id}: {m.uri}")
    resource_ledger.count(artifacts_published=1)
    if outcome.executed and m.resources is not None:  # what `compass status` sums for the run
        create_table_artifact(key=artifact_key(ctx.plan.spec_name, resource_ledger.TABLE, step.name),
                              table=[m.resources.row()], description=f"{step.id}: its resource ledger")
        resource_ledger.count(artifacts_published=1)
    for name, rows in (outcome.result.tables if outcome.result else _cached_tables(step, m)).items():
        if rows:
            create_table_artifact(key=artifact_key(ctx.plan.spec_name, name, step.name), table=rows,
                                  description=f"{step.id}: {name}")
            resource_ledger.count(artifacts_published=1)


# tables a cached step publishes again from its manifest's metrics, so every run shows them (`compass status` and
# `submit --watch` read the verdict from the success table whether the report ran or was reused)
CACHED_TABLES = {"report": ("success", "criteria")}


def _cached_tables(step: Step, manifest: Any) -> dict[str, list[dict]]:
    if step.kind not in CACHED_TABLES:
        return {}
    name, metric = CACHED_TABLES[step.kind]
    rows = (manifest.metrics or {}).get(metric)
    return {name: rows} if isinstance(rows, list) else {}


def _cached_summary(store: Store, step: Step, manifest: Any) -> str:
    """The summary the step wrote when it ran, marked as cached."""
    if any(f.path == SUMMARY_FILE for f in manifest.files):
        return f"{store.read_bytes(manifest.uri, SUMMARY_FILE).decode()}\n\n*cached: committed earlier*"
    return f"### {step.id}\n\ncached: committed earlier"


MAX_EMBEDDED_PLOT_BYTES = 1_000_000


def _embedded_plots(store: Store, manifest: Any) -> str:
    """The artifact's top-level PNG plots (loss, curves, comparisons) inlined as data URIs: the UI shows them
    without any access to the store, local or S3."""
    parts = []
    for entry in manifest.files:
        if entry.path.endswith(".png") and "/" not in entry.path and entry.size <= MAX_EMBEDDED_PLOT_BYTES:
            data = base64.b64encode(store.read_bytes(manifest.uri, entry.path)).decode()
            parts.append(f"\n**{entry.path}**\n\n![{entry.path}](data:image/png;base64,{data})\n")
    return "".join(parts)


def _with_options(step: Step, orch: Orchestration, limited: frozenset[str]):
    """A step's Prefect task: named by its kind, its run by its step id (the flow run is named by the spec), tagged
    `gpu` when it holds devices and the server has a concurrency limit on that tag (`compass deploy` sets one), and
    otherwise not at all. Prefect asks the server for concurrency slots for every tag a task carries, and on SQLite
    (the local server) that request collides with the server's own writes and comes back 503, retried 2 s later: a
    kind tag on every task cost a cached re-run of the minimal spec 1-4 s of its 1.1 s, and a flow of 40 steps a
    minute; a `gpu` tag no limit counts still cost each run 2 s. The kind is the task's name, which the UI filters
    and groups by."""
    timeout = orch.step_timeouts.get(step.kind, orch.timeout_seconds)
    return execute_step.with_options(
        name=f"{step.kind}", task_run_name=step.id, retries=orch.retries,
        retry_delay_seconds=orch.retry_delay_seconds, timeout_seconds=timeout, retry_condition_fn=worth_retrying,
        tags=[tag for tag in step.tags if tag in limited],
    )


def limited_tags(plan: Plan) -> frozenset[str]:
    """The plan's task tags that a concurrency limit on the server counts (one request per tag, once per run)."""
    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectNotFound

    limited: set[str] = set()
    tags = {tag for step in plan.steps for tag in step.tags}
    if tags:
        with get_client(sync_client=True) as client:
            for tag in sorted(tags):
                try:
                    client.read_concurrency_limit_by_tag(tag)
                    limited.add(tag)
                except ObjectNotFound:
                    pass
    return frozenset(limited)


def worth_retrying(task: Any, task_run: Any, state: Any) -> bool:
    """Retries are for faults (a killed process, a server that went away), not for wrong data or a wrong spec,
    which fail the same way every time: those end the step at once, with their message."""
    return not isinstance(state.data, (DataError, SpecError))


def _ray_options(ctx: RunContext, step: Step):
    """Ray resources a step's task asks for, from its placement (a no-op with the local task runner). A data step
    that spreads its work over Ray (datatrove's RayPipelineExecutor) has a driver that takes no CPU slot, or with
    every slot held by such drivers their inner tasks would never be scheduled."""
    resources = launcher_for(placement_of(ctx, step)).ray_resources(ctx.runtime.how)
    if not resources:
        return nullcontext()
    from prefect_ray.context import remote_options

    return remote_options(**resources)


def _clock(spec: TrainingSpec, plan: Plan) -> RunClock | None:
    """The run's time-left estimate; none when the plan's model cannot time this spec (a display never fails a
    run)."""
    try:
        return RunClock(plan, predicted_seconds(spec, plan))
    except Exception as exc:  # noqa: BLE001 - any failure of the estimate only costs the estimate
        get_run_logger().warning("no time-left estimate for this run: %s", exc)
        return None


def run_plan(plan: Plan, ctx: RunContext, orch: Orchestration, clock: RunClock | None = None) -> list[StepRecord]:
    """Submit each step once its inputs are done, at most `max_parallel_steps` at a time.

    Submitting only ready steps means no worker thread ever blocks waiting for an upstream step; the finished
    upstream futures still go in `wait_for`, so the Prefect UI draws the DAG's edges.
    """
    try:
        return _run_ready_steps(plan, ctx, orch, clock)
    except (KeyboardInterrupt, TerminationSignal) as exc:  # steps' threads would keep the process alive
        stop_run(exc)


def _run_ready_steps(plan: Plan, ctx: RunContext, orch: Orchestration,
                     clock: RunClock | None = None) -> list[StepRecord]:
    _resolve_imports_of_steps_to_compute(plan, ctx)
    started = time.monotonic()
    limited = limited_tags(plan)
    pending = list(plan.steps)
    running: dict[str, PrefectFuture] = {}
    finished: dict[str, PrefectFuture] = {}
    completed: queue.SimpleQueue[str] = queue.SimpleQueue()  # step ids, as their threads end
    results: list[StepRecord] = []
    failure: BaseException | None = None
    while pending or running:
        ready = [s for s in pending if set(s.needs) <= set(finished)] if failure is None else []
        gpu_running = sum(GPU_TAG in plan.step(sid).tags for sid in running)
        # steps whose work runs in Slurm job arrays take turns: each one's arrays already spread over the whole data
        # phase, and drivers holding CPUs while their arrays wait for those CPUs would deadlock a small partition
        drivers_running = sum(_drives_arrays(ctx, plan.step(sid)) for sid in running)
        local_devices = orch.task_runner != "ray"  # Ray places them itself (and no step holds devices under Slurm)
        for step in ready:
            if len(running) >= orch.max_parallel_steps:
                break
            if GPU_TAG in step.tags and local_devices:
                if gpu_running >= orch.max_parallel_gpu_steps:
                    continue
                gpu_running += 1
            if _drives_arrays(ctx, step):
                if drivers_running:
                    continue
                drivers_running += 1
            options = _with_options(step, orch, limited)
            with _ray_options(ctx, step):
                future = options.submit(ctx, step, wait_for=[finished[d] for d in step.needs])
            future.add_done_callback(lambda _, step_id=step.id: completed.put(step_id))
            running[step.id] = future
            pending.remove(step)
        if not running:
            break
        step_id = _next_completed(completed)
        done = finished[step_id] = running.pop(step_id)
        try:
            results.append(done.result())
            get_run_logger().info(run_progress(results, len(plan.steps), time.monotonic() - started)
                                  + (clock.line(results) if clock else ""))
        except (KeyboardInterrupt, TerminationSignal):
            raise  # the run stops now (run_plan), not after the running steps
        except BaseException as exc:  # let the running steps finish, submit nothing new, then fail the flow
            failure = failure or exc
    if failure is not None:
        raise failure
    return results


def _next_completed(completed: queue.SimpleQueue[str]) -> str:
    """The next step whose thread ended, waited for in slices: a signal the kernel delivers to a step's thread
    leaves the main thread's wait uninterrupted, and its handler (SIGTERM's TerminationSignal) runs only when
    the main thread next runs Python, which a wait without a timeout postpones until a step ends."""
    while True:
        try:
            return completed.get(timeout=0.5)
        except queue.Empty:
            continue


def _resolve_imports_of_steps_to_compute(plan: Plan, ctx: RunContext) -> None:
    """In the main thread, before any step's thread starts: imports racing in threads hand out partially initialized
    modules (torch, transformers' lazy names). Only the kinds with a step to compute in this process: a step found
    committed imports nothing, and a step run as a Slurm job imports in its own process."""
    to_compute = [s for s in plan.steps
                  if placement_of(ctx, s).computes_here and not ctx.store.is_committed(step_uri(ctx, s))]
    for kind in {registry.kind(s.kind).name: registry.kind(s.kind) for s in to_compute}.values():
        kind.import_names()


@contextmanager
def _rehearsing(rehearsal: bool) -> Iterator[None]:
    """A rehearsal's steps, and the jobs and ranks they start (which inherit this process's environment), may
    compute a GPU spec on CPU nodes (model/training/rank_device.py); only while the rehearsal runs."""
    if not rehearsal:
        yield
        return
    saved = os.environ.get(REHEARSAL_ENV)
    os.environ[REHEARSAL_ENV] = "1"
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(REHEARSAL_ENV, None)
        else:
            os.environ[REHEARSAL_ENV] = saved


def _drives_arrays(ctx: RunContext, step: Step) -> bool:
    return placement_of(ctx, step).drives_arrays


@flow(name="compass-lifecycle", task_runner=ThreadPoolTaskRunner(max_workers=8), log_prints=False,
      persist_result=False)
def lifecycle(spec_yaml: str, spec_path: str = "spec.yaml", base_dir: str | None = None,
              store_root: str | None = None, until: list[str] | None = None,
              spec_hash: str | None = None, smoke: bool = False, no_recompute: bool = False,
              rehearse: bool = False) -> dict[str, Any]:
    """Validate the spec, compile it, publish the plan, then run every step compass can execute.

    `spec_hash`, when given (`compass submit` gives it), must be the hash of `spec_yaml`: a run never trains
    a spec other than the one its submitter validated. `smoke` runs the spec at smoke size, `rehearse` at rehearsal
    size (compass.specs.smoke);
    `no_recompute` stops at a damaged cached artifact (how.storage.on_damage: stop)."""
    quiet_data_errors()
    logger = get_run_logger()
    base = Path(base_dir) if base_dir else Path.cwd()
    size = "smoke" if smoke else "rehearsal" if rehearse else "full"
    checked = None if spec_hash else checked_already(spec_yaml, base, size)  # `compass run`'s, in this process
    parsed = checked.spec if checked else parse_spec_text(spec_yaml, spec_path, base).spec
    block = parsed.how.storage.credentials_block
    if apply_credentials_block(block):  # before the spec's s3:// paths are read and stamped
        logger.info("store credentials from Prefect Secret block '%s'", block)
    if checked is None:
        original = load_spec_text(spec_yaml, spec_path, base_dir=base)
        if spec_hash and spec_hash != original.spec_hash:
            raise ValueError(f"{spec_path}: spec_hash {spec_hash[:12]} does not match the spec text "
                             f"({original.spec_hash[:12]}); submit the spec again")
        checked = check(shrunk(original, size))
    loaded, spec = checked.loaded, checked.spec
    if _needs_ray_runner(spec.how.orchestration):  # a deployment starts this flow with its default runner
        return lifecycle.with_options(task_runner=task_runner_for(spec.how.orchestration))(
            spec_yaml=spec_yaml, spec_path=spec_path, base_dir=base_dir, store_root=store_root, until=until,
            smoke=smoke, no_recompute=no_recompute, rehearse=rehearse)
    full = checked.plan
    plan = full.up_to(until) if until else full
    own = None if store_root or not deployment.id else worker_store(spec.how.storage.root, size)
    root = store_root or own or spec.how.storage.root_at(base)
    if own:  # the submitter named no store: a local root of theirs means nothing here
        logger.info("store %s: this worker's --store (the spec's how.storage.root %s is the submitter's folder)",
                    own, spec.how.storage.root)
    if deployment.id:  # submitted to a shared worker: read local files only under its own roots, never the submitter's
        outside = [*outside_roots(spec, base, worker_roots()), *writes_outside_worker(spec, base)]
        if outside:
            raise SpecError(loaded.problems(outside))
    unwritable = root_problem(root) or (store_outside_worker(root) if deployment.id else None)
    if unwritable:  # before anything is created there
        raise RootRefused(f"store_root {root}: {unwritable}")
    store = Store(root, spec.how.orchestration.shared_root)
    with _recorded_run(store):
        statuses = plan_status(full, store, depth="sizes")  # each step checks its artifact again when it runs
        create_markdown_artifact(
            key=artifact_key(spec.name, "plan"),
            markdown=f"## compass plan: {spec.name}\n\nspec hash `{loaded.spec_hash[:16]}`, store `{store.root}`\n\n"
                     + to_markdown([dag_section(full, statuses, store.root), *cost_sections(spec),
                                    consumption_section(spec, source_sizes(full, statuses, store))]),
            description=f"plan of {spec.name}")
        left_out = [s.id for s in full.steps if s.id not in plan.fingerprints]
        if left_out:
            logger.info("left out (--until %s): %s", " ".join(until or []), ", ".join(left_out))
        orch = spec.how.orchestration
        how = spec.how
        if no_recompute:
            how = how.model_copy(update={"storage": how.storage.model_copy(update={"on_damage": "stop"})})
        runtime = Runtime(how=how, base_dir=base, run=spec.name)
        ctx = RunContext(plan, store, loaded.spec_hash, runtime)
        with _rehearsing(loaded.size == "rehearsal"):
            results = run_plan(plan, ctx, orch, _clock(spec, plan))
        ran = [r.step for r in results if r.executed]
        logger.info("%d steps ran, %d cached, %d left out", len(ran), len(results) - len(ran), len(left_out))
        # a flow run's page is linked when a server outlives the run (a temporary server ends with it)
        served = flow_run.id and os.environ.get("PREFECT_API_URL") and not temporary_server_running()
        outcome = run_outcome(results, store, ui_url(flow_run.id) if served else None)
        small = None
        if loaded.size != "full":
            small = smoke_table(plan, spec, loaded.size_changes, loaded.size, results, store)
            create_table_artifact(key=artifact_key(spec.name, loaded.size), table=small,
                                  description=f"{loaded.size} run of {spec_path}: what each step exercised "
                                              "and shrank")
        summary = RunSummary(spec=spec.name, store=store.root, steps=results, left_out=left_out, flow_pid=os.getpid(),
                             outcome=outcome, **({loaded.size: small} if small is not None else {}))
        return summary.model_dump(mode="json")  # JSON across the flow run's boundary: RunSummary reads it back


def _recorded_run(store: Store):
    """First end the flow runs of this store that a kill left Running, then hold this run's own record."""
    for run in end_dead_runs(store):
        get_run_logger().warning("flow run %s of this store was left Running by a killed process (%s pid %d): "
                                 "marked Crashed", run.flow_run_id, run.host, run.pid)
    return run_record(store, str(flow_run.id)) if flow_run.id else nullcontext()


def task_runner_for(orch: Orchestration) -> Any:
    """The task runner `how.orchestration` asks for: threads here, or Ray (an existing cluster or a local one).

    Ray workers report task runs to the Prefect API, so Ray needs a running server (PREFECT_API_URL); with the
    embedded one each worker would start a server of its own."""
    if orch.task_runner != "ray":
        return ThreadPoolTaskRunner(max_workers=8)  # run_plan itself keeps max_parallel_steps running
    from prefect.settings import PREFECT_API_URL
    from prefect_ray import RayTaskRunner

    if not PREFECT_API_URL.value():
        raise RayNeedsServer("how.orchestration.task_runner: ray needs a Prefect server: start one "
                             "(`prefect server start --host 127.0.0.1`) and set PREFECT_API_URL, or use "
                             "task_runner: local")
    if orch.ray_address:
        return RayTaskRunner(address=orch.ray_address)
    return RayTaskRunner(init_kwargs=local_ray_init_kwargs(orch))


def local_ray_init_kwargs(orch: Orchestration) -> dict[str, Any]:
    """How this run starts its own Ray instance. Ray starts workers at niceness 15 to keep its driver responsive,
    but here the workers are the run's compute: behind any other busy process on the node they got a few percent of
    a CPU, and a two-minute run took over fifteen. Workers run at the driver's priority instead."""
    kwargs: dict[str, Any] = {"_system_config": {"worker_niceness": 0}}
    if orch.ray_num_cpus:
        kwargs["num_cpus"] = orch.ray_num_cpus
    return kwargs


def _needs_ray_runner(orch: Orchestration) -> bool:
    from prefect.context import FlowRunContext

    current = FlowRunContext.get()
    return (orch.task_runner == "ray" and current is not None
            and type(current.task_runner).__name__ != "RayTaskRunner")


class RayNeedsServer(RuntimeError):
    pass

