"""A real Slurm cluster on this machine for the tests: munged, slurmctld and slurmd with a generated slurm.conf in a
temporary folder, on free loopback ports, stopped by PID. Needs root and Debian's slurm-wlm and munge
(infra/setup.sh installs them).

One node named after this host, or (`nodes` > 1) emulated nodes `node1`, `node2`, ...: one slurmd each, started with
`-N` on a port of its own (Slurm's multiple-slurmd mode, built into Debian's slurmd), every one declaring
`gpus_per_node` GPUs as GRES backed by device files of its own (links to /dev/null: slurmd requires character
devices). Slurm then sets CUDA_VISIBLE_DEVICES, SLURM_STEP_GPUS, SLURM_LOCALID and SLURMD_NODENAME for each task
exactly as on a GPU node, which is what a rehearsal of a multi-node GPU launch needs; the CPUs are this machine's,
declared by every node. One slurmd per network namespace would give each node its own host name, at the cost of
root-only namespaces and a bridge; the jobs compass submits never depend on the host name, so `-N` suffices."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from compass.infra.net import free_port

DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch", "scontrol")


def missing() -> str:
    """Why a cluster cannot start here ('' when it can)."""
    absent = [d for d in DAEMONS if not shutil.which(d) and not Path(f"/usr/sbin/{d}").exists()]
    if absent:
        return f"Slurm is not installed ({', '.join(absent)} missing): infra/setup.sh installs slurm-wlm and munge"
    if os.geteuid() != 0:
        return "starting slurmd needs root"
    return ""


def _memory_mb() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) // 1024 - 2048
    return 4096


def _nodes_conf(host: str, nodes: int, gpus_per_node: int, cpu_partition: bool = False) -> str:
    gres = f" Gres=gpu:{gpus_per_node}" if gpus_per_node else ""
    if nodes == 1:
        lines = [f"NodeName={host} CPUs={os.cpu_count()} RealMemory={_memory_mb()}{gres} State=UNKNOWN"]
        members = host
    else:
        lines = [f"NodeName={name} NodeHostname={host} NodeAddr=127.0.0.1 Port={free_port()} CPUs={os.cpu_count()} "
                 f"RealMemory={_memory_mb() // nodes}{gres} State=UNKNOWN" for name in node_names(nodes)]
        members = f"node[1-{nodes}]"
    lines.append(f"PartitionName=debug Nodes={members} Default=YES MaxTime=INFINITE State=UP")
    if cpu_partition:
        lines.append(f"PartitionName=cpu Nodes={members} MaxTime=INFINITE State=UP")
    return "\n".join(lines) + "\n"


# A site's rule (job_submit.lua, as many GPU sites have): the GPU partition `debug` takes only jobs that ask for
# GPUs; jobs that ask none go to the partition `cpu`.
GPU_JOBS_ONLY = """function slurm_job_submit(job_desc, part_list, submit_uid)
  local partition = job_desc.partition or "debug"
  local asked = (job_desc.tres_per_node or "") .. (job_desc.tres_per_job or "") ..
                (job_desc.tres_per_task or "") .. (job_desc.tres_per_socket or "")
  if partition == "debug" and not string.find(asked, "gpu") then
    slurm.log_user("partition debug takes only jobs that ask for GPUs: use the partition cpu")
    return slurm.ERROR
  end
  return slurm.SUCCESS
end

function slurm_job_modify(job_desc, job_rec, part_list, modify_uid)
  return slurm.SUCCESS
end

return slurm.SUCCESS
"""


def node_names(nodes: int) -> list[str]:
    return [f"node{i + 1}" for i in range(nodes)]


def _gres_conf(folder: Path, nodes: list[str], gpus_per_node: int) -> str:
    """Each node's GPUs as device files of its own (slurmd checks they are character devices), GPU i close to CPU
    core i (modulo the cores), as NVML reports a GPU node's topology: `--gpu-bind=closest` then binds as it does
    there."""
    cpus = os.cpu_count() or 1
    lines = ["AutoDetect=off"]
    for node in nodes:
        devices = folder / "dev" / node
        devices.mkdir(parents=True)
        for index in range(gpus_per_node):
            (devices / f"nvidia{index}").symlink_to("/dev/null")
            lines.append(f"NodeName={node} Name=gpu File={devices}/nvidia{index} Cores={index % cpus}")
    return "\n".join(lines) + "\n"


def _conf(folder: Path, host: str, socket_path: Path, nodes: int, gpus_per_node: int,
          slurmd_timeout: int | None = None, max_array_size: int | None = None, gpu_jobs_only: bool = False) -> str:
    return f"""ClusterName=compass-test
SlurmctldHost={host}
SlurmctldPort={free_port()}
SlurmdPort={free_port()}
SlurmUser=root
AuthType=auth/munge
AuthInfo=socket={socket_path}
CredType=cred/munge
StateSaveLocation={folder}/state
SlurmdSpoolDir={folder}/spool/%n
SlurmctldPidFile={folder}/slurmctld.pid
SlurmdPidFile={folder}/slurmd-%n.pid
SlurmctldLogFile={folder}/slurmctld.log
SlurmdLogFile={folder}/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/affinity
JobCompType=jobcomp/filetxt
JobCompLoc={folder}/jobcomp.log
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MpiDefault=none
ReturnToService=2
JobRequeue=1
KillWait=10
MinJobAge=600
SchedulerType=sched/backfill
{f"SlurmdTimeout={slurmd_timeout}" if slurmd_timeout else ""}
{f"MaxArraySize={max_array_size}" if max_array_size else ""}
{"GresTypes=gpu" if gpus_per_node else ""}
{"JobSubmitPlugins=lua" if gpu_jobs_only else ""}
{_nodes_conf(host, nodes, gpus_per_node, cpu_partition=gpu_jobs_only)}"""


def _wait(check, what: str, timeout: float = 60) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if check():
            return
        time.sleep(0.3)
    raise TimeoutError(f"{what} did not come up within {timeout:.0f} s")


def lose_node(conf: str, node: str) -> None:
    """A node dies: its slurmd, its job steps' slurmstepd and every task Slurm started there, killed at once (the
    tasks name their node in SLURMD_NODENAME, the steps are their parents; only the cluster of `conf`, by
    SLURM_CONF)."""
    import psutil

    marks = {f"SLURMD_NODENAME={node}".encode(), f"SLURM_CONF={conf}".encode()}
    doomed: set[int] = {int(Path(conf).with_name(f"slurmd-{node}.pid").read_text())}
    for proc in psutil.process_iter(["pid"]):
        try:
            if marks <= set(Path(f"/proc/{proc.pid}/environ").read_bytes().split(b"\0")):
                doomed.add(proc.pid)
                parent = proc.parent()
                while parent is not None and "slurmstepd" not in " ".join(parent.cmdline()):
                    parent = parent.parent()
                if parent is not None:
                    doomed.add(parent.pid)
        except (OSError, psutil.Error):
            continue
    for pid in doomed:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def restart_node(conf: str, node: str) -> subprocess.Popen:
    """The lost node back (its slurmd started again, as after a reboot); the caller stops it (SIGTERM)."""
    return subprocess.Popen(["slurmd", "-D", "-f", conf, "-N", node], env={**os.environ, "SLURM_CONF": conf},
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def finished_jobs(conf: str | Path) -> list[dict[str, str]]:
    """Every job the controller of `conf` finished, as its completion log (jobcomp/filetxt) holds it: key=value
    fields (JobId, Name, JobState, NodeCnt, ...)."""
    log = Path(conf).with_name("jobcomp.log")
    if not log.exists():
        return []
    return [dict(field.split("=", 1) for field in line.split() if "=" in field)
            for line in log.read_text().splitlines() if line.strip()]


def strays(conf: Path) -> list[int]:
    """What Slurm started for the cluster of `conf` and is still running: its step daemons (slurmstepd, which carry
    the slurmd's environment) and the jobs' tasks (SLURM_JOB_ID), all with its SLURM_CONF. Not the processes a test
    started beside the cluster with SLURM_CONF in their environment (a session's Prefect server)."""
    mark = f"SLURM_CONF={conf}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            with contextlib.suppress(OSError):
                env = (entry / "environ").read_bytes().split(b"\0")
                slurms = (entry / "cmdline").read_bytes().startswith(b"slurmstepd") or \
                    any(e.startswith(b"SLURM_JOB_ID=") for e in env)
                if mark in env and slurms:
                    found.append(int(entry.name))
    return found


@contextmanager
def slurm_cluster(folder: Path, nodes: int = 1, gpus_per_node: int = 0, slurmd_timeout: int | None = None,
                  max_array_size: int | None = None, gpu_jobs_only: bool = False) -> Iterator[dict[str, str]]:
    """Start the cluster; yields the environment that points Slurm's commands at it (SLURM_CONF). `slurmd_timeout`:
    seconds without an answer before the controller declares a node down (Slurm's default: 300);
    `max_array_size`: tasks per job array at most (Slurm's default: 1001); `gpu_jobs_only`: the default partition
    refuses jobs that ask for no GPU (GPU_JOBS_ONLY), a partition `cpu` of the same nodes takes them."""
    host = socket.gethostname()
    names = [host] if nodes == 1 else node_names(nodes)
    folder.mkdir(parents=True, exist_ok=True)
    munge = Path(tempfile.mkdtemp(prefix="compass-munge-"))  # the munge user cannot enter root's 0700 folders
    for sub in ["state", *(f"spool/{name}" for name in names)]:
        (folder / sub).mkdir(parents=True)
    key = munge / "munge.key"
    key.write_bytes(os.urandom(1024))
    shutil.chown(munge, "munge", "munge")
    shutil.chown(key, "munge", "munge")
    key.chmod(0o400)
    munge.chmod(0o755)  # munged insists that everyone may reach its socket
    sock = munge / "munge.socket"
    conf = folder / "slurm.conf"
    conf.write_text(_conf(folder, host, sock, nodes, gpus_per_node, slurmd_timeout, max_array_size, gpu_jobs_only))
    if gpu_jobs_only:
        (folder / "job_submit.lua").write_text(GPU_JOBS_ONLY)  # slurmctld reads it beside slurm.conf
    if gpus_per_node:
        (folder / "gres.conf").write_text(_gres_conf(folder, names, gpus_per_node))
    env = {**os.environ, "SLURM_CONF": str(conf)}
    procs: list[subprocess.Popen] = []
    try:
        procs.append(subprocess.Popen(
            ["runuser", "-u", "munge", "--", "munged", "-F", f"--socket={sock}", f"--key-file={key}",
             f"--pid-file={munge}/munged.pid", f"--log-file={munge}/munged.log", f"--seed-file={munge}/seed"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        _wait(sock.exists, "munged")
        sock.chmod(0o777)
        procs.append(subprocess.Popen(["slurmctld", "-D", "-i", "-f", str(conf)], env=env,
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        for name in names:
            procs.append(subprocess.Popen(["slurmd", "-D", "-f", str(conf), "-N", name], env=env,
                                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))

        def node_idle() -> bool:
            out = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %T"], env=env, capture_output=True, text=True).stdout
            states = dict(line.split() for line in out.splitlines() if line.strip())  # a node of 2 partitions: 2 lines
            return len(states) == len(names) and all(s in ("idle", "mixed", "allocated") for s in states.values())

        _wait(node_idle, "the Slurm node", timeout=90)
        yield {"SLURM_CONF": str(conf)}
    finally:
        subprocess.run(["scancel", "--full", "-u", "root"], env=env, capture_output=True)
        for proc in reversed(procs):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in reversed(procs):
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for pid in strays(conf):  # a job step whose slurmd was killed (a lost node) is nobody's child: stopped here
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        shutil.rmtree(munge, ignore_errors=True)
