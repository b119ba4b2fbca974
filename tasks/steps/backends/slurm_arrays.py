"""A datatrove stage as Slurm job arrays, submitted from the step's driver job (one CPU per task, the data phase's
nodes x CPUs at once): datatrove's SlurmPipelineExecutor. A stage of more tasks than the cluster's MaxArraySize is
several arrays, submitted together (datatrove's max_array_launch_parallel), the data phase's CPUs shared among them:
not waves, each waiting for the last to end. A stage's array job ids are recorded in its logging folder when they
are submitted, so a relaunched driver follows arrays that are still running rather than submitting their ranks
twice."""

from __future__ import annotations

import contextlib
import getpass
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

from compass.infra import interrupt
from compass.infra.slurm import ask_controller, cluster_setting
from compass.specs.how import Shape, SlurmCluster
from compass.tasks.steps.backends.base import Log, Stage

ARRAY_RECORD = "array_job.json"
DEFAULT_MEMORY_PER_CPU_GB = 2


class ArrayStage:
    """One stage as job arrays of `shape` (the data phase's): `run()` follows the arrays an earlier attempt
    recorded, or submits them, and waits until the controller holds none of their tasks."""

    def __init__(self, stage: Stage, shape: Shape, cluster: SlurmCluster, log: Log):
        self.stage, self.shape, self.cluster, self.log = stage, shape, cluster, log
        self.executor = _array_executor(stage, shape, cluster)

    def run(self) -> None:
        _follow_or_submit(self.executor, self.stage, self.cluster, self.log)

    def get_incomplete_ranks(self, ranks: Iterable[int] | None = None,
                             skip_completed: bool | None = None) -> list[int]:
        return self.executor.get_incomplete_ranks(ranks, skip_completed=skip_completed)


def _array_executor(stage: Stage, shape: Shape, cluster: SlurmCluster):
    from compass.tasks.steps.backends.executors import ArrayExecutor, JobIds

    memory_per_cpu = DEFAULT_MEMORY_PER_CPU_GB
    if shape.memory_gb and shape.cpus_per_node:
        memory_per_cpu = max(1, -(-int(shape.memory_gb) // shape.cpus_per_node))
    sbatch = {"account": cluster.account, "constraint": cluster.constraint,
              "exclude": ",".join(cluster.exclude) or None}
    max_array = array_size_limit()
    arrays = -(-stage.tasks // max_array)
    cpus = shape.nodes * shape.cpus_per_node if shape.cpus_per_node else -1
    return ArrayExecutor(
        stage.pipeline, tasks=stage.tasks, time=shape.time_limit, partition=shape.partition, qos=cluster.qos,
        cpus_per_task=1, mem_per_cpu_gb=memory_per_cpu,
        workers=max(1, cpus // arrays) if cpus > 0 else -1,  # the phase's CPUs shared by the arrays running at once
        max_array_size=max_array, max_array_launch_parallel=True, job_id_retriever=JobIds(),
        job_name=f"compass-{stage.name}"[:60], requeue=cluster.requeue,
        env_command=f"export PATH={Path(sys.executable).parent}:$PATH",
        sbatch_args={k: v for k, v in sbatch.items() if v}, logging_dir=str(stage.logging_dir), skip_completed=True)


def _follow_or_submit(executor, stage: Stage, cluster: SlurmCluster, log: Log) -> None:
    """Submit the stage's arrays (or follow those an earlier attempt submitted) and wait for them."""
    logging_dir, launched = stage.logging_dir, executor.job_id_retriever
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
            log.info("stage %s: every one of its %d tasks completed in an earlier attempt", logging_dir.name,
                     stage.tasks)
            return
        record.write_text(json.dumps({"job_ids": launched.ids, "submitted_at": time.time()}))
        log.info("stage %s: Slurm array %s of %d tasks (logs %s)", logging_dir.name, job_ids,
                 len(executor.get_incomplete_ranks()), executor.slurm_logs_folder)
    stop = interrupt.on_stop(lambda: _cancel(job_ids))
    try:
        _wait(job_ids, cluster.poll_seconds, log, logging_dir.name)
    finally:
        interrupt.remove_on_stop(stop)


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


def _recorded_live_jobs(record: Path, name: str, log: Log) -> str:
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


def _wait(job_id: str, poll_s: float, log: Log, stage: str) -> None:
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
