"""Steps as Slurm jobs: a generated sbatch script per step, submitted, followed, cancelled, and found again.

A generated script rather than submitit: submitit pickles a Python function per job, while a compass step is
already a command (`python -m compass.tasks.steps.step_job STEP.json`); a script of twenty lines that a person
can read in the step's work folder, and run again by hand with sbatch, is the smaller thing.

The batch step runs the whole step on the job's first node; a training step starts its ranks over the job's
nodes with srun (ranks_command). With requeue, Slurm sends USR1 to the batch shell `signal_before_s` before the
time limit; the shell touches a stop file, the trainer sees it at its next step (all ranks agree), writes a
checkpoint and exits, and the shell requeues the job. A requeued job (by that, by `scontrol requeue`, or after a
node failure) runs the same script again and the trainer resumes from its newest checkpoint.

The job's id is recorded in the step's work folder (on the cluster's shared root) as soon as it is submitted. An
orchestrator that died is replaced by one that finds the record: a live job is followed, never submitted twice;
one that finished while nobody watched has committed its step already; one that failed is submitted again.
"""

from __future__ import annotations

import contextlib
import getpass
import logging
import os
import re
import shlex
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from compass.infra import interrupt
from compass.infra.exits import RETRIABLE_EXIT
from compass.infra.layout import WorkFolder
from compass.specs.how import Shape, SlurmCluster

log = logging.getLogger("compass.slurm")
SUCCESS = "COMPLETED"
FAILED = {"FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE", "PREEMPTED",
          "SPECIAL_EXIT", "REVOKED"}
SETTLE_S = 15.0  # a failed state that lasts this long is final (a requeued job passes through NODE_FAIL)


class SlurmJobFailed(RuntimeError):
    """The job ended in a state other than COMPLETED; the message ends with its last log lines."""


@dataclass(frozen=True)
class JobRequest:
    """What one step's job asks Slurm for, and the command its batch step runs on the first node."""

    workdir: Path
    command: tuple[str, ...]
    label: str
    nodes: int
    tasks_per_node: int  # the ranks of a node when each rank is its own task (launch: srun), else 1
    cpus_per_task: int | None
    gpus_per_node: int | None  # None on CPU
    memory_gb: float | None
    time_limit: str | None
    exclusive: bool  # the job takes whole nodes (every device, no CPU count given)
    whole_nodes: bool = False  # every device of its nodes: without memory_gb it asks for all their memory
    fault_requeues: int = 0  # times the batch shell requeues the job for a retriable fault (infra/exits.py)
    partition: str | None = None  # the phase's partition (None: the cluster's default)


def request_for(shape: Shape, cluster: SlurmCluster, accelerator: str, workdir: Path, command: tuple[str, ...],
                label: str, fault_requeues: int = 0) -> JobRequest:
    """The job of a step of `shape` on this cluster; it requeues itself `fault_requeues` times for retriable faults
    (with `cluster.requeue`)."""
    tasks = shape.devices_per_node if cluster.launch == "srun" and shape.devices_per_node else 1
    return JobRequest(workdir=workdir, command=command, label=label, nodes=shape.nodes, tasks_per_node=tasks,
                      cpus_per_task=max(1, shape.cpus_per_node // tasks) if shape.cpus_per_node else None,
                      gpus_per_node=shape.devices_per_node if accelerator != "cpu" and shape.devices_per_node else None,
                      memory_gb=shape.memory_gb, time_limit=shape.time_limit,
                      exclusive=shape.whole_nodes and shape.cpus_per_node is None, whole_nodes=shape.whole_nodes,
                      fault_requeues=fault_requeues if cluster.requeue else 0, partition=shape.partition)


@dataclass(frozen=True)
class JobState:
    state: str
    restarts: int
    reason: str
    nodes: str
    name: str = ""  # what the controller says of the job itself: a record is followed only when they match
    user: str = ""
    work_dir: str = ""
    submitted_at: float | None = None

    @classmethod
    def parse(cls, line: str) -> JobState:
        fields = dict(part.split("=", 1) for part in shlex.split(line) if "=" in part)
        submitted = None
        with contextlib.suppress(ValueError, OverflowError):
            submitted = time.mktime(time.strptime(fields.get("SubmitTime", ""), "%Y-%m-%dT%H:%M:%S"))
        return cls(fields.get("JobState", "UNKNOWN"), int(fields.get("Restarts", 0) or 0),
                   fields.get("Reason", ""), fields.get("NodeList", ""), fields.get("JobName", ""),
                   fields.get("UserId", "").split("(", 1)[0], fields.get("WorkDir", ""), submitted)

    @property
    def live(self) -> bool:
        return self.state != SUCCESS and self.state not in FAILED


class JobRecord(BaseModel):
    """The job a step's work folder belongs to, written when it is submitted. Followed (and cancelled) only while
    the controller's own account of the job matches it (`not_this_steps`): a planted or stale record, or an id the
    controller has since given another job, never makes compass follow or cancel someone else's job."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    job_id: str = Field(pattern=r"^[0-9]{1,20}$")  # a Slurm job id: digits only, never an option to a command
    script: Path
    submitted_at: float
    host: str
    pid: int


def sbatch_script(job: JobRequest, cluster: SlurmCluster) -> str:
    """The batch script of one step's job (written beside the job, readable and re-runnable by hand)."""
    work = WorkFolder(job.workdir)
    options = [f"--job-name=compass-{job.label}", f"--nodes={job.nodes}", f"--ntasks-per-node={job.tasks_per_node}",
               f"--output={work.slurm_log}", "--open-mode=append", f"--chdir={job.workdir}"]
    if job.cpus_per_task:
        options.append(f"--cpus-per-task={job.cpus_per_task}")
    if job.gpus_per_node:
        options.append(f"--gpus-per-node={job.gpus_per_node}")
    if job.exclusive:
        options.append("--exclusive")
    if job.memory_gb:
        options.append(f"--mem={max(1, round(job.memory_gb * 1024))}M")
    elif job.whole_nodes:  # every rank builds its model in fp32 on the host and snapshots checkpoints there: a
        options.append("--mem=0")  # site's default memory per CPU (often a few GB) kills a 3B job; 0: the node's
    for flag, value in (("partition", job.partition), ("account", cluster.account), ("qos", cluster.qos),
                        ("constraint", cluster.constraint), ("time", job.time_limit)):
        if value is not None:
            options.append(f"--{flag}={value}")
    if cluster.exclude:
        options.append(f"--exclude={','.join(cluster.exclude)}")
    if cluster.requeue:
        options += ["--requeue", f"--signal=B:USR1@{cluster.signal_before_s}"]
    else:
        options.append("--no-requeue")
    lines = ["#!/bin/bash", *(f"#SBATCH {o}" for o in options), "",
             f"export COMPASS_STOP_FILE={shlex.quote(str(work.stop_file))}",
             'rm -f "$COMPASS_STOP_FILE"',
             'echo "compass: job $SLURM_JOB_ID, restart ${SLURM_RESTART_COUNT:-0}, nodes $SLURM_JOB_NODELIST"',
             "requeue=0",
             'on_time_limit() { echo "compass: time limit near: checkpoint and requeue"; '
             'touch "$COMPASS_STOP_FILE"; requeue=1; }',
             "trap on_time_limit USR1",
             # the ranks' rendezvous: the first node's address as Slurm reaches it (NodeAddr), else its name
             'head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
             'COMPASS_HEAD=$(scontrol show node "$head_node" -o | sed -n "s/.* NodeAddr=\\([^ ]*\\).*/\\1/p")',
             'export COMPASS_HEAD=${COMPASS_HEAD:-$head_node}',
             f"{shlex.join(job.command)} &",
             "step=$!",
             'while true; do wait "$step"; status=$?; kill -0 "$step" 2>/dev/null || break; done',
             'if [ "$requeue" = 1 ]; then echo "compass: requeueing job $SLURM_JOB_ID"; '
             'scontrol requeue "$SLURM_JOB_ID"; exit 0; fi',
             *_fault_requeue(work, job.fault_requeues, cluster.exclude),
             'exit "$status"', ""]
    return "\n".join(lines)


def ranks_command(module_argv: list[str], python: str, nodes: int, ranks_per_node: int, port: int,
                  launch: str, gpus: bool) -> list[str]:
    """From inside a job's batch step: srun starting `ranks_per_node` ranks of `python -m ...` on each of the job's
    nodes, each rank told its rank, its node's rank count, the world size and the rendezvous (the job's first
    node). With launch srun each rank is a Slurm task bound to its share of the node's CPUs; with torchrun one task
    per node runs torchrun over the node's CPUs. Either way the step asks for `--gpus-per-node` and no GPU binding, so
    Slurm gives every task all of its node's GPUs in CUDA_VISIBLE_DEVICES, and each rank opens the one at its local
    rank (model/training/rank_device.py), as DeepSpeed, DDP and accelerate do by themselves: a task bound to its own
    GPU (`--gpus-per-task=1`) sees it as cuda:0 while they open cuda:LOCAL_RANK. Not `--gpu-bind=none` either: Slurm
    (22.05, rehearsed in tests/test_rehearsal_cluster.py) then sets no CUDA_VISIBLE_DEVICES at all, and a rank on a
    node shared with other jobs would see their GPUs too."""
    cpus_on_node = int(os.environ.get("SLURM_CPUS_ON_NODE", "1"))
    head = os.environ.get("COMPASS_HEAD") or socket.gethostname()
    common = ["srun", "--kill-on-bad-exit=1", f"--nodes={nodes}"]
    devices = [f"--gpus-per-node={ranks_per_node}"] if gpus else []
    if launch == "srun":
        rank = ('export RANK=$SLURM_PROCID LOCAL_RANK=$SLURM_LOCALID WORLD_SIZE=$SLURM_NTASKS '
                f'LOCAL_WORLD_SIZE={ranks_per_node} MASTER_ADDR={shlex.quote(head)} MASTER_PORT={port}; exec '
                + shlex.join([python, *module_argv]))
        return [*common, f"--ntasks-per-node={ranks_per_node}",
                f"--cpus-per-task={max(1, cpus_on_node // ranks_per_node)}", *devices, "bash", "-c", rank]
    torchrun = [python, "-m", "torch.distributed.run", "--nnodes", str(nodes)]
    per_node = ["--nproc-per-node", str(ranks_per_node), "--master-addr", head, "--master-port", str(port)]
    node = shlex.join(torchrun) + ' --node-rank "$SLURM_NODEID" ' + shlex.join([*per_node, *module_argv])
    return [*common, "--ntasks-per-node=1", f"--cpus-per-task={cpus_on_node}", *devices, "bash", "-c", node]


LAUNCH_FAILED = re.compile(r"Task launch for \S+ failed on node (\S+): (.+)")  # srun's words (22.05 to 24.x)
# srun's line for a task a signal ended (`srun: error: gpu-12: task 3: Aborted (core dumped)`): NCCL's watchdog
# aborts (SIGABRT) before Python sees an error, the kernel or a watchdog kills (SIGKILL), a driver fault (SIGBUS)
SIGNAL_DEATH = re.compile(r"srun: error: (?P<node>\S+): tasks? (?P<tasks>[\d,\-\[\]]+): "
                          r"(?P<signal>Aborted|Killed|Bus error|Segmentation fault)")
# a task that ended by itself with an error (`srun: error: gpu-12: task 0: Exited with exit code 75`): the tasks a
# signal ends after it are the ones srun terminated for it (--kill-on-bad-exit), not the fault
EXITED = re.compile(r"srun: error: \S+: tasks? [\d,\-\[\]]+: Exited with exit code")


@dataclass(frozen=True)
class RanksStepEnd:
    """How srun starting a step's ranks ended: its exit status, the nodes it could not start them on with
    Slurm's reason (their slurmd gone or refusing: the ranks there never ran), and the ranks a signal ended before
    any rank exited by itself, as srun said (`gpu-12: task 3: Aborted`), the first one first (srun then terminates
    the others)."""

    code: int
    unlaunched: tuple[str, ...] = ()
    signalled: tuple[str, ...] = ()

    @property
    def unlaunched_nodes(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(line.split(":", 1)[0] for line in self.unlaunched))

    @property
    def first_signalled_node(self) -> str | None:
        """The node of the rank a signal ended first: the others srun terminated after it."""
        return self.signalled[0].split(":", 1)[0] if self.signalled else None


def run_ranks_step(argv: list[str], cwd: Path) -> RanksStepEnd:
    """Run srun (ranks_command), passing its standard error through to the job's log, ranks' lines included,
    while reading Slurm's own launch failures from it."""
    proc = subprocess.Popen(argv, cwd=cwd, stderr=subprocess.PIPE)
    assert proc.stderr is not None
    out = getattr(sys.stderr, "buffer", None)
    unlaunched, signalled, exited = [], [], False
    for line in proc.stderr:
        if out is not None:
            out.write(line)
            out.flush()
        else:
            sys.stderr.write(line.decode(errors="replace"))
        text = line.decode(errors="replace")
        if found := LAUNCH_FAILED.search(text):
            unlaunched.append(f"{found[1]}: {found[2].strip()}")
        if EXITED.search(text):
            exited = True
        elif (died := SIGNAL_DEATH.search(text)) and not exited:
            signalled.append(f"{died['node']}: task {died['tasks']}: {died['signal']}")
    return RanksStepEnd(proc.wait(), tuple(unlaunched), tuple(signalled))


def _fault_requeue(work: WorkFolder, budget: int, excluded: list[str]) -> list[str]:
    """Batch-shell lines: a step that exits RETRIABLE_EXIT (a hung or broken collective, a failed device, a rank a
    signal ended after progress, or ranks srun could not start on a lost node: infra/exits.py) requeues its own job,
    at most `budget` times in any 24 hours of the job's life (each fault's time appended in the work folder;
    time-limit requeues do not spend it): a 384-GPU run meets several faults over weeks, each resumed from the newest
    checkpoint with no orchestrator alive, while a fault that repeats at once (a bad node back, a bug) still stops.
    The nodes the faults were seen on (WorkFolder.fault_nodes) are left out of the requeued job, with the cluster's
    own `exclude`, while the partition keeps enough other nodes for the job (else it would wait forever)."""
    if budget <= 0:
        return []
    times, faulty = shlex.quote(str(work.failure_requeues)), shlex.quote(str(work.fault_nodes))
    static = shlex.quote(",".join(excluded))
    return [f'if [ "$status" = {RETRIABLE_EXIT} ]; then',
            f'  now=$(date +%s); echo "$now" >> {times}',
            f"  faults=$(awk -v since=$(( now - 86400 )) '$1 >= since' {times} | wc -l)",
            f'  if [ "$faults" -le {budget} ]; then echo "compass: a retriable fault (exit {RETRIABLE_EXIT}: a hung or '
            f'broken collective, a failed device, a rank ended by a signal, or a lost node): requeue $faults of '
            f'{budget} in 24 hours"',
            "    exclude=''",
            f'    if [ -s {faulty} ]; then',
            f'      left_out=$(scontrol show hostnames "$(sort -u {faulty} | paste -sd, -),"{static} | sort -u)',
            '      others=$(sinfo -h -N -p "$SLURM_JOB_PARTITION" -o %N | sort -u | grep -cvxF -f <(echo "$left_out"))',
            '      if [ "$others" -ge "${SLURM_JOB_NUM_NODES:-1}" ]; then exclude=$(echo "$left_out" | paste -sd, -); '
            'echo "compass: the requeued job leaves out node(s) $exclude (where faults were seen)"; '
            'else echo "compass: the faulty node(s) stay in: $others other node(s) in partition $SLURM_JOB_PARTITION, '
            'the job needs ${SLURM_JOB_NUM_NODES:-1}"; fi',
            "    fi",
            # Slurm ends the requeued job's processes (SIGTERM, then SIGKILL after KillWait): the shell outlives the
            # TERM to set the pending job's excluded nodes, which a running job's cannot be
            "    trap 'true' TERM",
            '    scontrol requeue "$SLURM_JOB_ID"',
            '    if [ -n "$exclude" ]; then for _ in $(seq 20); do scontrol update JobId="$SLURM_JOB_ID" '
            'ExcNodeList="$exclude" 2>/dev/null && break; sleep 1; done; fi',
            "    exit 0",
            "  fi",
            f'  echo "compass: {budget} retriable faults in 24 hours already, the budget of '
            f'how.orchestration.retries: the job ends here"',
            "fi"]


def submit(script: Path) -> str:
    done = subprocess.run(["sbatch", "--parsable", str(script)], capture_output=True, text=True, timeout=120)
    if done.returncode:
        raise SlurmJobFailed(f"sbatch refused {script}: {done.stderr.strip() or done.stdout.strip()}")
    return done.stdout.strip().split(";")[0]


class ControllerUnreachable(RuntimeError):
    """Slurm's controller did not answer for longer than compass waits: the job's fate is unknown, not "done"."""


FORGOTTEN = "Invalid job id"  # what squeue and scontrol say of a job the controller no longer holds
CONTROLLER_PATIENCE_S = 900.0  # a controller restart or failover takes minutes; a three-week job outlives it


def ask_controller(argv: list[str], patience_s: float | None = None) -> str | None:
    """The output of a Slurm query about a job; None when the controller no longer knows the job. A query that
    fails otherwise (controller restarting, overloaded, a network blip) is asked again with backoff for
    `patience_s`, then raises ControllerUnreachable: it is never read as "the job is gone", which made a
    follower take a running job, or a running array, for finished."""
    deadline = time.monotonic() + (CONTROLLER_PATIENCE_S if patience_s is None else patience_s)
    delay = 1.0
    while True:
        try:
            done = subprocess.run(argv, capture_output=True, text=True, timeout=60)
            if done.returncode == 0:
                return done.stdout
            if FORGOTTEN in done.stderr:
                return None
            why = done.stderr.strip() or f"exit {done.returncode}"
        except subprocess.TimeoutExpired:
            why = "no answer within 60 s"
        if time.monotonic() + delay > deadline:
            raise ControllerUnreachable(f"`{shlex.join(argv)}` failed for {patience_s or CONTROLLER_PATIENCE_S:.0f} "
                                        f"s: {why}; the job may still run: `squeue`, then run compass again to "
                                        "follow it")
        log.warning("Slurm's controller did not answer (%s); asking again in %.0f s", why, delay)
        time.sleep(delay)
        delay = min(delay * 2, 30.0)


def cluster_setting(key: str, patience_s: float = 60) -> str:
    """One setting of the controller's configuration (`scontrol show config`: ClusterName, MaxArraySize, ...); ''
    where it does not say or does not answer within `patience_s`."""
    try:
        out = ask_controller(["scontrol", "show", "config"], patience_s=patience_s) or ""
    except (ControllerUnreachable, OSError):
        return ""
    for line in out.splitlines():
        name, _, value = line.partition("=")
        if name.strip() == key:
            return value.strip()
    return ""


SUBMIT_CLOCK_SLACK_S = 120.0  # the controller's clock against this machine's, and SubmitTime's whole seconds


def not_this_steps(record: JobRecord, state: JobState, job: JobRequest) -> str | None:
    """Why the job a step's record names is not that step's job (None: it is): its name is not the step's
    `compass-<label>`, it belongs to another user, it works in another folder, or it was submitted before the
    record was written (an id the controller gave another job)."""
    expected = f"compass-{job.label}"
    if state.name and state.name != expected:
        return f"its name is {state.name}, not {expected}"
    if state.user and state.user != getpass.getuser():
        return f"it belongs to {state.user}"
    if state.work_dir and os.path.realpath(state.work_dir) != os.path.realpath(job.workdir):
        return f"it works in {state.work_dir}, not {job.workdir}"
    if state.submitted_at is not None and state.submitted_at < record.submitted_at - SUBMIT_CLOCK_SLACK_S:
        return "it was submitted before the record was written"
    return None


def state_of(job_id: str) -> JobState | None:
    """The job's state from the controller (None once it has forgotten the job)."""
    out = ask_controller(["scontrol", "show", "job", "-o", "--", job_id])
    if not out or not out.strip():
        return None
    return JobState.parse(out.strip().splitlines()[0])


def cancel(job_id: str) -> None:
    subprocess.run(["scancel", "--", job_id], capture_output=True, timeout=60)


def read_record(workdir: Path) -> JobRecord | None:
    """The step's job record; None where there is none or it does not read as one (an id that is not a Slurm job
    id included)."""
    with contextlib.suppress(FileNotFoundError, ValueError):
        return JobRecord.model_validate_json(WorkFolder(workdir).job_record.read_text())
    return None


class LogFollower:
    """New lines of the job's log, as they are written, into the step's log."""

    def __init__(self, path: Path, log: logging.Logger | logging.LoggerAdapter, prefix: str, offset: int = 0):
        self.path, self.log, self.prefix, self.offset = path, log, prefix, offset
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


def run_on_slurm(job: JobRequest, cluster: SlurmCluster, log: logging.Logger | logging.LoggerAdapter,
                 done: Callable[[], bool], on_job: Callable[[str], None] = lambda job_id: None) -> str:
    """Run the step's job to completion: follow the one its work folder records when that one is still queued or
    running (submitted by an earlier orchestrator), else submit one. `done()` says whether the job's work is
    committed (for a job the controller has forgotten); `on_job` hears the job id (the step's lock records it).
    Returns the job id; raises SlurmJobFailed when the job ends otherwise than COMPLETED. The job is cancelled if
    this process is stopped or the step fails here; a killed orchestrator leaves it running for the next one."""
    work = WorkFolder(job.workdir)
    record = read_record(job.workdir)
    if record is None and work.job_record.exists():
        log.warning("%s is not a job record compass wrote (unreadable, or its job id is not a Slurm job id): ignored",
                    work.job_record)
    state = state_of(record.job_id) if record else None
    if record and state is not None and (why := not_this_steps(record, state, job)):
        log.warning("the record in %s names Slurm job %s, which is not this step's job (%s): not followed, not "
                    "cancelled; submitting the step's own", work.job_record, record.job_id, why)
        record, state = None, None
    if record and done():
        log.info("Slurm job %s finished its step while nobody watched", record.job_id)
        return record.job_id
    if record and state is not None and state.live:
        job_id = record.job_id
        log.info("following Slurm job %s (%s), submitted by %s pid %s at %s", job_id, state.state, record.host,
                 record.pid, time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(record.submitted_at)))
    else:
        if record:
            log.warning("Slurm job %s ended %s without committing the step: submitting it again", record.job_id,
                        state.state if state else "(forgotten by the controller)")
        work.batch_script.write_text(sbatch_script(job, cluster))
        job_id = submit(work.batch_script)
        record = JobRecord(job_id=job_id, script=work.batch_script, submitted_at=time.time(),
                           host=socket.gethostname(), pid=os.getpid())
        tmp = work.job_record.with_suffix(".tmp")
        tmp.write_text(record.model_dump_json())
        tmp.rename(work.job_record)
        log.info("submitted Slurm job %s (%s); log %s", job_id, work.batch_script, work.slurm_log)
    on_job(job_id)
    size = work.slurm_log.stat().st_size if work.slurm_log.exists() else 0
    follower = LogFollower(work.slurm_log, log, f"[slurm {job_id}]", offset=size if state and state.live else 0)
    stop = interrupt.on_stop(lambda: cancel(job_id))
    finished = False
    try:
        final = _follow(job_id, cluster.poll_seconds, follower, log, done)
        finished = True
    finally:
        interrupt.remove_on_stop(stop)
        follower.pump()
        if not finished:  # the step failed or was cancelled here: the job must not go on unseen
            cancel(job_id)
            log.warning("cancelled Slurm job %s", job_id)
    if final != SUCCESS:
        raise SlurmJobFailed(f"Slurm job {job_id} ended {final}; last lines of {follower.path}:\n{follower.tail()}")
    return job_id


def _follow(job_id: str, poll_s: float, follower: LogFollower, log: logging.Logger | logging.LoggerAdapter,
            done: Callable[[], bool]) -> str:
    """Poll until the job completes or fails for good; log state changes and requeues."""
    last: JobState | None = None
    failed_since: float | None = None
    while True:
        follower.pump()
        state = state_of(job_id)
        if state is None:  # forgotten by the controller (MinJobAge passed): the commit decides
            return SUCCESS if done() else "UNKNOWN (forgotten by the controller, nothing committed)"
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
