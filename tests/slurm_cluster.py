"""A real one-node Slurm cluster on this machine for the tests: munged, slurmctld and slurmd with a generated
slurm.conf in a temporary folder, on free loopback ports, stopped by PID. Needs root and Debian's slurm-wlm
and munge (infra/setup.sh installs them)."""

from __future__ import annotations

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


def _conf(folder: Path, host: str, socket_path: Path) -> str:
    return f"""ClusterName=compass-test
SlurmctldHost={host}
SlurmctldPort={free_port()}
SlurmdPort={free_port()}
SlurmUser=root
AuthType=auth/munge
AuthInfo=socket={socket_path}
CredType=cred/munge
StateSaveLocation={folder}/state
SlurmdSpoolDir={folder}/spool
SlurmctldPidFile={folder}/slurmctld.pid
SlurmdPidFile={folder}/slurmd.pid
SlurmctldLogFile={folder}/slurmctld.log
SlurmdLogFile={folder}/slurmd.log
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
NodeName={host} CPUs={os.cpu_count()} RealMemory={_memory_mb()} State=UNKNOWN
PartitionName=debug Nodes={host} Default=YES MaxTime=INFINITE State=UP
"""


def _wait(check, what: str, timeout: float = 60) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if check():
            return
        time.sleep(0.3)
    raise TimeoutError(f"{what} did not come up within {timeout:.0f} s")


@contextmanager
def slurm_cluster(folder: Path) -> Iterator[dict[str, str]]:
    """Start the cluster; yields the environment that points Slurm's commands at it (SLURM_CONF)."""
    host = socket.gethostname()
    folder.mkdir(parents=True, exist_ok=True)
    munge = Path(tempfile.mkdtemp(prefix="compass-munge-"))  # the munge user cannot enter root's 0700 folders
    for sub in ("state", "spool"):
        (folder / sub).mkdir()
    key = munge / "munge.key"
    key.write_bytes(os.urandom(1024))
    shutil.chown(munge, "munge", "munge")
    shutil.chown(key, "munge", "munge")
    key.chmod(0o400)
    munge.chmod(0o755)  # munged insists that everyone may reach its socket
    sock = munge / "munge.socket"
    conf = folder / "slurm.conf"
    conf.write_text(_conf(folder, host, sock))
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
        procs.append(subprocess.Popen(["slurmd", "-D", "-f", str(conf), "-N", host], env=env,
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))

        def node_idle() -> bool:
            out = subprocess.run(["sinfo", "-h", "-o", "%T"], env=env, capture_output=True, text=True).stdout
            return out.strip() in ("idle", "mixed", "allocated")

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
        shutil.rmtree(munge, ignore_errors=True)
