"""One datatrove stage, run by the executor the step's placement names: datatrove's LocalPipelineExecutor with the
phase's CPUs, its RayPipelineExecutor on Ray tasks, or, under a Slurm cluster, its SlurmPipelineExecutor as job
arrays submitted from the step's driver job (one CPU per task, the data phase's nodes x CPUs at once). A stage of
more tasks than the cluster's MaxArraySize is several arrays, submitted together (datatrove's
max_array_launch_parallel), the data phase's CPUs shared among them: not waves, each waiting for the last to end.

A stage's datatrove logging folder (completion markers, per-rank statistics, Slurm logs) lives in the step's work
folder, which survives a failed attempt: a relaunched step skips the ranks that completed and redoes only the rest.
A stage's array job ids are recorded there when they are submitted, so a relaunched driver follows arrays that are
still running rather than submitting their ranks twice.
"""

from __future__ import annotations

import contextlib
import getpass
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import multiprocess
from pydantic import BaseModel, ConfigDict

from compass.infra import interrupt
from compass.infra.die_with_parent import children_die_with_this_thread
from compass.infra.slurm import ask_controller, cluster_setting
from compass.specs.how import Shape, SlurmCluster
from compass.tasks.steps.context import Runtime
from compass.tasks.steps.launchers import launcher_for

ARRAY_RECORD = "array_job.json"
DEFAULT_MEMORY_PER_CPU_GB = 2
# datatrove runs a local stage of one worker in the calling process, and each of its ranks resets loguru's global
# sinks to its own task log: two such stages on parallel step threads would write into each other's logs.
_IN_PROCESS = threading.Lock()
# What a local stage's pool workers import to run the data steps' pipelines, imported once by the forkserver that
# forks them: every worker of every later stage starts with them loaded (each paid ~0.5 s of imports per stage).
# Light on purpose: no torch, no transformers.
WORKER_MODULES = ("compass.infra.forkserver_preload", "compass.tasks.data.executors",
                  "compass.tasks.data.curate_blocks", "compass.tasks.data.source_reader",
                  "compass.tasks.data.token_shards", "compass.tasks.data.fence_blocks",
                  "compass.tasks.data.written_files", "compass.model.training.token_files",
                  "datatrove.pipeline.readers", "datatrove.pipeline.dedup", "tokenizers")


class BlockStats(BaseModel):
    """One pipeline block's counters, summed over the stage's ranks (datatrove's merged statistics)."""

    model_config = ConfigDict(frozen=True)

    name: str
    stats: dict[str, Any]


class StageStats(BaseModel):
    model_config = ConfigDict(frozen=True)

    stage: str
    tasks: int
    blocks: list[BlockStats]


class StageIncomplete(RuntimeError):
    """Some ranks of a stage did not complete: the step fails, and its relaunch redoes only those ranks."""


def run_stage(runtime: Runtime, stage: str, logs: Path, pipeline: list, tasks: int,
              log: logging.Logger | logging.LoggerAdapter, input_bytes: int | None = None,
              cost_per_byte: float = 1.0) -> StageStats:
    """Run one datatrove pipeline of `tasks` ranks with the executor the placement says and return its merged
    block statistics; raises StageIncomplete naming the ranks that did not complete. `input_bytes`, when known,
    times `cost_per_byte` (what a byte costs this stage against reading and writing it: specs/how.CONTENT_BYTE_COST):
    a local stage with less than how.orchestration.in_process_below_mib of such work runs in this process."""
    logging_dir = logs / stage
    in_process = False
    placement = runtime.placement
    orch = runtime.how.orchestration
    backend = launcher_for(placement).stages
    if backend == "slurm_arrays" and placement.tasks is not None and orch.cluster is not None:
        executor = _run_as_array(pipeline, tasks, logging_dir, placement.tasks, orch.cluster,
                                 f"{runtime.run}-{stage}", log)
    else:
        if backend == "ray":
            from datatrove.executor import RayPipelineExecutor

            executor = RayPipelineExecutor(pipeline, tasks=tasks, workers=orch.workers,
                                           logging_dir=str(logging_dir), skip_completed=True)
        else:

            from compass.tasks.data.executors import LocalExecutor

            multiprocess.set_forkserver_preload(list(WORKER_MODULES))  # forkserver_preload: workers die with the run
            shape = placement.shape
            workers = shape.cpus_per_node if shape and shape.cpus_per_node else orch.workers
            if input_bytes is not None and input_bytes * cost_per_byte < orch.in_process_below_mib * 2**20:
                workers = 1
            workers = min(tasks, workers)
            executor = LocalExecutor(pipeline, tasks=tasks, workers=workers, logging_dir=str(logging_dir),
                                     skip_completed=True)
            in_process = workers == 1
        with _IN_PROCESS if in_process else contextlib.nullcontext(), children_die_with_this_thread():
            executor.run()  # children_die_with_this_thread: datatrove's Manager process too
    from compass.tasks.data.executors import rank_failure

    missing = executor.get_incomplete_ranks(range(tasks), skip_completed=True)
    failures = [e for e in (rank_failure(logging_dir, r) for r in missing) if e is not None]
    if failures:  # the first failed rank's own error (a broken record names its file and line)
        log.warning("datatrove stage %s: ranks %s of %d failed; run again to redo only those", stage, missing, tasks)
        raise failures[0]
    if missing:  # Ray's executor logs a lost task group and returns; an array task may be cancelled or fail
        raise StageIncomplete(f"datatrove stage {stage} finished without ranks {missing} of {tasks}; see "
                              f"{logging_dir / 'logs'}; run again to redo only those ranks")
    blocks = _merged_block_stats(logging_dir, tasks)
    return StageStats(stage=stage, tasks=tasks,
                      blocks=[BlockStats(name=str(b.get("name")), stats=_plain(b.get("stats", {}))) for b in blocks])


def link_outputs(src: Path, dst: Path) -> int:
    """The files the stages wrote under `src` into the artifact folder `dst`: hard links where both are on one
    file system (the work folder keeps its copy until the commit, for a relaunch), else copies. Returns how many."""
    count = 0
    for path in sorted(src.rglob("*")):
        if path.is_file():
            count += 1
            target = dst / path.relative_to(src)
            target.parent.mkdir(parents=True, exist_ok=True)
            try:
                os.link(path, target)
            except OSError:
                shutil.copy2(path, target)
    return count


def _run_as_array(pipeline: list, tasks: int, logging_dir: Path, shape: Shape, cluster: SlurmCluster, name: str,
                  log: logging.Logger | logging.LoggerAdapter):
    """Submit the stage as a Slurm job array (or follow the one an earlier attempt submitted) and wait for it."""
    from compass.tasks.data.executors import ArrayExecutor, JobIds

    memory_per_cpu = DEFAULT_MEMORY_PER_CPU_GB
    if shape.memory_gb and shape.cpus_per_node:
        memory_per_cpu = max(1, -(-int(shape.memory_gb) // shape.cpus_per_node))
    sbatch = {"account": cluster.account, "constraint": cluster.constraint,
              "exclude": ",".join(cluster.exclude) or None}
    max_array = array_size_limit()
    arrays = -(-tasks // max_array)
    cpus = shape.nodes * shape.cpus_per_node if shape.cpus_per_node else -1
    launched = JobIds()
    executor = ArrayExecutor(
        pipeline, tasks=tasks, time=shape.time_limit, partition=shape.partition, qos=cluster.qos,
        cpus_per_task=1, mem_per_cpu_gb=memory_per_cpu,
        workers=max(1, cpus // arrays) if cpus > 0 else -1,  # the phase's CPUs shared by the arrays running at once
        max_array_size=max_array, max_array_launch_parallel=True, job_id_retriever=launched,
        job_name=f"compass-{name}"[:60], requeue=cluster.requeue,
        env_command=f"export PATH={Path(sys.executable).parent}:$PATH",
        sbatch_args={k: v for k, v in sbatch.items() if v}, logging_dir=str(logging_dir), skip_completed=True)
    record = logging_dir / ARRAY_RECORD
    job_ids = _recorded_live_jobs(record, executor.job_name, log)
    if job_ids:
        log.info("stage %s: following Slurm array %s submitted by an earlier attempt", logging_dir.name, job_ids)
    else:
        logging_dir.mkdir(parents=True, exist_ok=True)
        with _outside_this_job():
            executor.launch_job()
        job_ids = ",".join(launched.ids)
        if not job_ids:
            log.info("stage %s: every one of its %d tasks completed in an earlier attempt", logging_dir.name, tasks)
            return executor
        record.write_text(json.dumps({"job_ids": launched.ids, "submitted_at": time.time()}))
        log.info("stage %s: Slurm array %s of %d tasks (logs %s)", logging_dir.name, job_ids,
                 len(executor.get_incomplete_ranks()), executor.slurm_logs_folder)
    stop = interrupt.on_stop(lambda: _cancel(job_ids))
    try:
        _wait(job_ids, cluster.poll_seconds, log, logging_dir.name)
    finally:
        interrupt.remove_on_stop(stop)
    return executor


def array_size_limit() -> int:
    """The cluster's MaxArraySize (tasks per array), Slurm's default 1001 where the controller does not say."""

    value = cluster_setting("MaxArraySize")
    return int(value) if value.isdigit() and int(value) > 0 else 1001


@contextlib.contextmanager
def _outside_this_job() -> Iterator[None]:
    """sbatch from inside the driver's job: the array must not inherit the driver's own SLURM_*/SBATCH_* settings
    (srun in each array task reads SLURM_MEM_PER_NODE, SLURM_CPUS_PER_TASK, ... and they would contradict the
    array's). SLURM_CONF stays: it names the cluster."""
    saved = {k: v for k, v in os.environ.items() if k.startswith(("SLURM_", "SBATCH_")) and k != "SLURM_CONF"}
    for key in saved:
        del os.environ[key]
    try:
        yield
    finally:
        os.environ.update(saved)


def _queued(job_id: str) -> list[str]:
    """The arrays' tasks the controller still holds (pending, running, completing; `job_id` one id or several,
    comma-separated), as `id state` lines; a
    controller that does not answer is asked again (infra/slurm.ask_controller), never taken for "none left"."""

    out = ask_controller(["squeue", "-h", "-r", "-o", "%i %T", "-j", job_id])
    return [line for line in (out or "").splitlines() if line.strip()]


def _recorded_live_jobs(record: Path, name: str, log: logging.Logger | logging.LoggerAdapter) -> str:
    """The recorded arrays' ids, comma-separated, while the controller still holds any of their tasks and every
    one of them is this stage's (its job name, this user: a planted or stale record names someone else's); ''."""


    with contextlib.suppress(FileNotFoundError, ValueError, KeyError, TypeError):
        data = json.loads(record.read_text())
        ids = [str(j) for j in data["job_ids"]] if "job_ids" in data else [str(data["job_id"])]
        if not ids or not all(re.fullmatch(r"[0-9]{1,20}", j) for j in ids):
            log.warning("%s names %s, not Slurm job ids: ignored", record, ids)
            return ""
        job_ids = ",".join(ids)
        held = ask_controller(["squeue", "-h", "-r", "-o", "%j %u", "-j", job_ids]) or ""
        owners = {tuple(line.split()[:2]) for line in held.splitlines() if line.strip()}
        if not owners:
            return ""
        foreign = sorted(owner for owner in owners if owner != (name, getpass.getuser()))
        if foreign:
            log.warning("%s names Slurm jobs %s, which are not this stage's (%s, not %s of %s): not followed, not "
                        "cancelled", record, job_ids, " ".join(foreign[0]), name, getpass.getuser())
            return ""
        return job_ids
    return ""


def _wait(job_id: str, poll_s: float, log: logging.Logger | logging.LoggerAdapter, stage: str) -> None:
    last = ""
    while queued := _queued(job_id):
        states: dict[str, int] = {}
        for line in queued:
            state = line.split()[-1]
            states[state] = states.get(state, 0) + 1
        summary = ", ".join(f"{n} {state.lower()}" for state, n in sorted(states.items()))
        if summary != last:
            log.info("stage %s: Slurm array %s: %s", stage, job_id, summary)
            last = summary
        time.sleep(poll_s)


def _cancel(job_id: str) -> None:
    subprocess.run(["scancel", "--", job_id], capture_output=True, timeout=60)


def _merged_block_stats(logging_dir: Path, tasks: int) -> list[dict[str, Any]]:
    """The stage's statistics merged from every rank's file, whichever attempt ran it (an executor's own
    stats.json covers only the ranks it ran, and Ray's is missing when it counted a resubmitted task as failed)."""
    from datatrove.utils.stats import PipelineStats

    total = PipelineStats()
    for rank in range(tasks):
        total += PipelineStats.from_json(json.loads((logging_dir / "stats" / f"{rank:05d}.json").read_text()))
    return json.loads(total.to_json())


def rank_block_stats(logs: Path, stage: str, tasks: int, block: str) -> list[dict[str, Any]]:
    """One block's counters for each rank of a completed stage, in rank order (a rank's shard is its own)."""
    from datatrove.utils.stats import PipelineStats

    found = []
    for rank in range(tasks):
        stats = PipelineStats.from_json(json.loads((logs / stage / "stats" / f"{rank:05d}.json").read_text()))
        blocks = json.loads(stats.to_json())
        found.append(next((_plain(b.get("stats", {})) for b in blocks if b.get("name") == block), {}))
    return found


def _plain(stats: dict[str, Any]) -> dict[str, Any]:
    return {key: value.get("total", value) if isinstance(value, dict) else value for key, value in stats.items()}
