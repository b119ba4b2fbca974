"""Training jobs on Slurm: a generated sbatch script, submitted, followed and cancelled from the step.

A generated script rather than submitit: submitit pickles a Python function per job, while a compass trainer is
already a command (`python -m compass.model.training.trainer JOB.json`) that torchrun starts per node; a script
of twenty lines that a person can read in the step's folder, and run again by hand with sbatch, is the smaller thing.

The script starts one srun task per node, which runs the node's ranks (the trainer itself for one rank, torchrun
for several). With requeue, Slurm sends USR1 to the batch shell `signal_before_s` before the time limit; the
shell touches a stop file, the trainer sees it at its next step (all ranks agree), writes a checkpoint and
exits, and the shell requeues the job. A requeued job (by that, by `scontrol requeue`, or after a node failure)
runs the same script again and the trainer resumes from its newest checkpoint; the step follows the same job id
throughout, streaming the job's log into its own, and takes the result only from a job that COMPLETED.
"""

from __future__ import annotations

import contextlib
import json
import logging
import shlex
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from compass.infra import interrupt
from compass.infra.launcher import TRAINER_MODULE
from compass.specs.how import SlurmCluster

STOP_FILE = "stop-requested"  # the batch shell asks the trainer to checkpoint and stop (model/callbacks.py)
JOB_FILE = "slurm-job.json"  # the job id of this step's work folder: a retried step follows or replaces it
SUCCESS = "COMPLETED"
FAILED = {"FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE", "PREEMPTED"}
SETTLE_S = 15.0  # a failed state that lasts this long is final (a requeued job passes through NODE_FAIL)


class SlurmJobFailed(RuntimeError):
    """The job ended in a state other than COMPLETED; the message ends with its last log lines."""


@dataclass(frozen=True)
class JobShape:
    """What the batch script needs of a training job: where it lives and how many ranks on how many nodes."""

    workdir: Path
    job_path: Path
    nodes: int
    ranks_per_node: int
    gpus_per_node: int | None  # None on CPU
    module: str = TRAINER_MODULE  # what each rank runs: `python -m MODULE JOB.json`

    @property
    def world_size(self) -> int:
        return self.nodes * self.ranks_per_node


@dataclass(frozen=True)
class JobState:
    state: str
    restarts: int
    reason: str
    nodes: str

    @classmethod
    def parse(cls, line: str) -> JobState:
        fields = dict(part.split("=", 1) for part in shlex.split(line) if "=" in part)
        return cls(fields.get("JobState", "UNKNOWN"), int(fields.get("Restarts", 0) or 0),
                   fields.get("Reason", ""), fields.get("NodeList", ""))


def sbatch_script(job: JobShape, cluster: SlurmCluster, python: str, label: str, port: int) -> str:
    """The batch script of one training job (written beside the job, readable and re-runnable by hand)."""
    workdir, job_path = job.workdir, job.job_path
    options = [f"--job-name=compass-{label}", f"--nodes={job.nodes}", "--ntasks-per-node=1",
               f"--output={workdir / 'slurm.log'}", "--open-mode=append", f"--chdir={workdir}"]
    if job.gpus_per_node:
        options.append(f"--gpus-per-node={job.gpus_per_node}")
    for flag, value in (("partition", cluster.partition), ("account", cluster.account), ("qos", cluster.qos),
                        ("constraint", cluster.constraint), ("cpus-per-task", cluster.cpus_per_task),
                        ("time", cluster.time_limit)):
        if value is not None:
            options.append(f"--{flag}={value}")
    if cluster.exclude:
        options.append(f"--exclude={','.join(cluster.exclude)}")
    if cluster.requeue:
        options += ["--requeue", f"--signal=B:USR1@{cluster.signal_before_s}"]
    else:
        options.append("--no-requeue")
    if job.world_size == 1:  # the rank's rendezvous, or DeepSpeed sees Slurm's variables and looks for MPI
        node = ("RANK=0 LOCAL_RANK=0 WORLD_SIZE=1 MASTER_ADDR=127.0.0.1 MASTER_PORT=" + str(port) + " "
                + shlex.join([python, "-m", job.module, str(job_path)]))
    else:
        node = (shlex.join([python, "-m", "torch.distributed.run", "--nnodes", str(job.nodes)])
                + ' --node-rank "$SLURM_NODEID" '
                + shlex.join(["--nproc-per-node", str(job.ranks_per_node), "--master-port", str(port)])
                + ' --master-addr "$COMPASS_HEAD" ' + shlex.join(["-m", job.module, str(job_path)]))
    stop = shlex.quote(str(workdir / STOP_FILE))
    lines = ["#!/bin/bash", *(f"#SBATCH {o}" for o in options), "",
             f"export COMPASS_STOP_FILE={stop}",
             'rm -f "$COMPASS_STOP_FILE"',
             'echo "compass: job $SLURM_JOB_ID, restart ${SLURM_RESTART_COUNT:-0}, nodes $SLURM_JOB_NODELIST"',
             "requeue=0",
             'on_time_limit() { echo "compass: time limit near: checkpoint and requeue"; '
             'touch "$COMPASS_STOP_FILE"; requeue=1; }',
             "trap on_time_limit USR1",
             'export COMPASS_HEAD=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
             f"srun --kill-on-bad-exit=1 --ntasks-per-node=1 bash -c {shlex.quote(node)} &",
             "step=$!",
             'while true; do wait "$step"; status=$?; kill -0 "$step" 2>/dev/null || break; done',
             'if [ "$requeue" = 1 ]; then echo "compass: requeueing job $SLURM_JOB_ID"; '
             'scontrol requeue "$SLURM_JOB_ID"; exit 0; fi',
             'exit "$status"', ""]
    return "\n".join(lines)


def submit(script: Path) -> str:
    done = subprocess.run(["sbatch", "--parsable", str(script)], capture_output=True, text=True, timeout=120)
    if done.returncode:
        raise SlurmJobFailed(f"sbatch refused {script}: {done.stderr.strip() or done.stdout.strip()}")
    return done.stdout.strip().split(";")[0]


def state_of(job_id: str) -> JobState | None:
    """The job's state from the controller (None once it has forgotten the job)."""
    done = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True, timeout=60)
    if done.returncode or not done.stdout.strip():
        return None
    return JobState.parse(done.stdout.strip().splitlines()[0])


def cancel(job_id: str) -> None:
    subprocess.run(["scancel", job_id], capture_output=True, timeout=60)


class LogFollower:
    """New lines of the job's log, as they are written, into the step's log."""

    def __init__(self, path: Path, log: logging.Logger | logging.LoggerAdapter, prefix: str):
        self.path, self.log, self.prefix, self.offset = path, log, prefix, 0
        self.partial = ""

    def pump(self) -> None:
        if not self.path.exists():
            return
        with self.path.open("r", errors="replace") as f:
            f.seek(self.offset)
            text = f.read()
            self.offset = f.tell()
        lines = (self.partial + text).split("\n")
        self.partial = lines.pop()
        for line in lines:
            if line.strip():
                self.log.info("%s %s", self.prefix, line)

    def tail(self, n: int = 40) -> str:
        return "\n".join(self.path.read_text(errors="replace").splitlines()[-n:]) if self.path.exists() else ""


def run_on_slurm(job: JobShape, cluster: SlurmCluster, python: str, label: str, port: int,
                 log: logging.Logger | logging.LoggerAdapter) -> dict:
    """Submit (or, after a crash of this process, follow again) the job of this work folder until it completes;
    returns the trainer's result. The job is cancelled if this step fails or the run is stopped."""
    workdir = job.workdir
    script = workdir / "job.sbatch"
    script.write_text(sbatch_script(job, cluster, python, label, port))
    record = workdir / JOB_FILE
    job_id = _live_job(record)
    if job_id:
        log.info("following Slurm job %s, submitted by an earlier attempt of this step", job_id)
    else:
        (workdir / "result.json").unlink(missing_ok=True)
        job_id = submit(script)
        record.write_text(json.dumps({"job_id": job_id, "script": str(script), "submitted_at": time.time()}))
        log.info("submitted Slurm job %s (%s); log %s", job_id, script, workdir / "slurm.log")
    follower = LogFollower(workdir / "slurm.log", log, f"[slurm {job_id}]")
    stop = interrupt.on_stop(lambda: cancel(job_id))
    finished = False
    try:
        final = _follow(job_id, cluster.poll_seconds, follower, log)
        finished = True
    finally:
        interrupt.remove_on_stop(stop)
        follower.pump()
        if not finished:  # the step failed or was cancelled here: the job must not train on unseen
            cancel(job_id)
            log.warning("cancelled Slurm job %s", job_id)
    record.unlink(missing_ok=True)
    result = workdir / "result.json"
    if final != SUCCESS or not result.exists():
        raise SlurmJobFailed(f"Slurm job {job_id} ended {final}"
                             + ("" if final != SUCCESS else " without a result.json")
                             + f"; last lines of {follower.path}:\n{follower.tail()}")
    return json.loads(result.read_text())


def _live_job(record: Path) -> str | None:
    """The job an earlier attempt submitted, if the controller still has it queued or running."""
    with contextlib.suppress(FileNotFoundError, ValueError, KeyError):
        job_id = json.loads(record.read_text())["job_id"]
        state = state_of(job_id)
        if state is not None and state.state not in FAILED and state.state != SUCCESS:
            return job_id
    return None


def _follow(job_id: str, poll_s: float, follower: LogFollower, log: logging.Logger | logging.LoggerAdapter) -> str:
    """Poll until the job completes or fails for good; log state changes and requeues."""
    last: JobState | None = None
    failed_since: float | None = None
    while True:
        follower.pump()
        state = state_of(job_id)
        if state is None:  # forgotten by the controller (MinJobAge passed): the result file decides
            return SUCCESS if (follower.path.parent / "result.json").exists() else "UNKNOWN"
        if last is None or (state.state, state.restarts) != (last.state, last.restarts):
            log.info("Slurm job %s: %s%s%s", job_id, state.state,
                     f" (restart {state.restarts})" if state.restarts else "",
                     f", {state.reason}" if state.reason not in ("", "None") else "")
        last = state
        if state.state == SUCCESS:
            return SUCCESS
        if state.state in FAILED:
            failed_since = failed_since or time.time()
            if time.time() - failed_since >= SETTLE_S:
                reason = f" ({state.reason})" if state.reason not in ("", "None") else ""
                return f"{state.state}{reason}, after {state.restarts} restarts"
        else:
            failed_since = None
        time.sleep(min(poll_s, SETTLE_S / 3) if failed_since else poll_s)
