"""Proof that the cluster's compute nodes see what the orchestrating machine sees, before anything is submitted.

The login node writes a token under the shared root; a one-task job (srun, on a compute node of each partition the
spec's jobs go to, asking one GPU where some ask GPUs: flows/validation.probed_partitions) reads it, writes one
back, and reports which of the other paths the steps will touch it cannot see (the store, local data, this Python).
The login node then reads the node's file. A shared root that is only mounted here, or a path only this machine
has, is named with the spec field to change, and nothing is submitted.

Once a probe passes, its answer is recorded under the shared root (`.compass-probe/verified-<key>.json`) and reused
for `probe_valid_hours` (a day) by every later check of the same question: the same cluster (Slurm's ClusterName),
partition, GPU or none, account, QOS, constraint and excluded nodes, shared root, paths, modules and Python. So a
`compass run` probes once per question (not again when its flow validates). Past that, a record is still reused
while a job of this user runs on that partition from a work folder under the shared root (squeue's %Z): that job's
nodes read and write the shared root as it runs, so a `compass run` that comes back after days to follow a live
48-node job, on a partition that job fills, submits no probe and needs no free node.

`python -m compass.infra.shared_probe FOLDER TOKEN PATH...` is the job's side.
"""

from __future__ import annotations

import getpass
import hashlib
import importlib.util
import json
import os
import shutil
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from compass.specs.how import SlurmCluster

FROM_LOGIN, FROM_NODE = "from-login", "from-node"


@dataclass(frozen=True)
class ProbeResult:
    node: str  # the compute node that answered ('' when no job ran)
    problem: str  # why the probe could not run or the shared root is not shared ('' when it is)
    unseen: tuple[str, ...]  # paths the node does not see
    missing_modules: tuple[str, ...] = ()  # modules the node's Python cannot import
    reused: bool = False  # answered by a recorded probe of the same question, no job submitted
    live_job: str = ""  # reused past its validity: the running job (under the shared root) that proves it

    @property
    def passed(self) -> bool:
        return not (self.problem or self.unseen or self.missing_modules)


def verified(cluster: SlurmCluster, paths: list[str], modules: list[str] | None = None,
             python: str = sys.executable, partition: str | None = None, gpus: int = 0,
             cluster_name: str = "", live_job: Callable[[str, str | None], str | None] | None = None) -> ProbeResult:
    """The probe's answer: a recorded pass of the same question younger than cluster.probe_valid_hours (or older,
    while `live_job(shared root, partition)` names a job of this user running there from under the shared root:
    default `live_job_under`), else a probe job (recorded when it passes). `partition`: where to probe (None: the
    cluster's); `gpus`: GPUs the probe job asks for, on a partition whose jobs ask for GPUs (sites refuse jobs
    that ask none there, and the GPU nodes are the ones to prove); `cluster_name`: the controller's ClusterName, so
    a record never answers for another cluster."""
    assert cluster.shared_root is not None
    question = _question(cluster, paths, modules, python, partition, gpus, cluster_name)
    record = Path(cluster.shared_root).expanduser() / ".compass-probe" / f"verified-{question}.json"
    try:
        seen = json.loads(record.read_text())
        age_s = time.time() - float(seen["at"])
        if age_s < cluster.probe_valid_hours * 3600:
            return ProbeResult(str(seen["node"]), "", (), (), reused=True)
        running = (live_job or live_job_under)(cluster.shared_root, partition or cluster.partition)
        if running:
            return ProbeResult(str(seen["node"]), "", (), (), reused=True, live_job=running)
    except (OSError, ValueError, KeyError, TypeError):
        pass
    result = probe(cluster, paths, modules, python, partition, gpus)
    if result.passed:
        try:
            partial = record.with_suffix(f".{uuid.uuid4().hex[:8]}.tmp")
            partial.write_text(json.dumps({"node": result.node, "at": time.time()}))
            partial.replace(record)
        except OSError:
            pass  # unrecorded: the next check probes again
    return result


def live_job_under(shared_root: str, partition: str | None) -> str | None:
    """A job of this user running on `partition` (None: any) whose working folder is under `shared_root` (squeue:
    job id, state, partition, working folder), or None."""
    root = os.path.realpath(os.path.expanduser(shared_root))
    try:
        done = subprocess.run(["squeue", "-h", "-u", getpass.getuser(), "-t", "RUNNING", "-o", "%i|%P|%Z"],
                              capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    for line in done.stdout.splitlines() if done.returncode == 0 else []:
        job_id, job_partition, folder = (line.split("|", 2) + ["", ""])[:3]
        inside = os.path.realpath(folder.strip()) + os.sep
        if inside.startswith(root.rstrip(os.sep) + os.sep) and (partition is None or
                                                                 partition in job_partition.split(",")):
            return job_id.strip()
    return None


def _question(cluster: SlurmCluster, paths: list[str], modules: list[str] | None, python: str,
              partition: str | None, gpus: int, cluster_name: str) -> str:
    """What a probe answers, as a key: the cluster it ran on and everything it was asked."""
    slurm = cluster.model_dump(include={"shared_root", "account", "qos", "constraint", "exclude"})
    slurm |= {"partition": partition or cluster.partition, "gpus": gpus}
    asked = {"cluster": cluster_name, "slurm": slurm,
             "paths": sorted(paths), "modules": sorted(modules or []), "python": python}
    return hashlib.sha256(json.dumps(asked, sort_keys=True).encode()).hexdigest()[:16]


def probe(cluster: SlurmCluster, paths: list[str], modules: list[str] | None = None,
          python: str = sys.executable, partition: str | None = None, gpus: int = 0) -> ProbeResult:
    """Run the probe job and judge what it saw (see the module docstring and `verified`)."""
    assert cluster.shared_root is not None
    root = Path(cluster.shared_root).expanduser()
    folder = root / ".compass-probe" / uuid.uuid4().hex[:12]
    try:
        folder.mkdir(parents=True)
    except OSError as exc:
        return ProbeResult("", f"cannot write under {root} on this machine ({exc.strerror})", ())
    token = uuid.uuid4().hex
    (folder / FROM_LOGIN).write_text(token)
    command = ["srun", f"--immediate={cluster.probe_timeout_s}", "--quiet", *_one_task(cluster, partition, gpus)]
    command += [python, "-m", "compass.infra.shared_probe", str(folder), token, ",".join(modules or []), *paths]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=cluster.probe_timeout_s + 120)
        answer = _answer(done.stdout)
        if answer is None:
            said = (done.stderr.strip() or done.stdout.strip()).splitlines()[-3:]
            return ProbeResult("", f"the probe job did not run ({done.returncode}): {' '.join(said)[:300]}", ())
        node = answer["node"]
        if not answer["read"]:
            return ProbeResult(node, f"{root} is not shared: node {node} does not see the file this machine "
                                     f"wrote there", ())
        back = folder / FROM_NODE
        if not back.exists() or back.read_text() != token:
            return ProbeResult(node, f"{root} is not shared: this machine does not see the file node {node} wrote "
                                     f"there", ())
        return ProbeResult(node, "", tuple(answer["unseen"]), tuple(answer["missing_modules"]))
    except subprocess.TimeoutExpired:
        return ProbeResult("", f"the probe job did not start within {cluster.probe_timeout_s} s", ())
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _one_task(cluster: SlurmCluster, partition: str | None, gpus: int) -> list[str]:
    """The probe's request: one task on one node for a few minutes, where and as the spec's jobs ask."""
    flags = ["--nodes=1", "--ntasks=1", "--time=5", "--job-name=compass-probe"]
    for flag, value in (("partition", partition or cluster.partition), ("account", cluster.account),
                        ("qos", cluster.qos), ("constraint", cluster.constraint)):
        if value is not None:
            flags.append(f"--{flag}={value}")
    if gpus:
        flags.append(f"--gpus-per-node={gpus}")
    if cluster.exclude:
        flags.append(f"--exclude={','.join(cluster.exclude)}")
    return flags


def refusal(cluster: SlurmCluster, partition: str | None, gpus: int = 0) -> str:
    """Why the controller would refuse the probe's one-task request ('' when it takes it): `sbatch --test-only`, so
    nothing runs or queues; the site's submit rules (job_submit plugins) and the partition's limits answer. For the
    jobs of a partition that ask no GPU where a probe with a GPU already proves its nodes."""
    command = ["sbatch", "--test-only", *_one_task(cluster, partition, gpus), "--wrap", "true"]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"`sbatch --test-only` failed ({exc})"
    if done.returncode == 0:
        return ""
    said = [line.removeprefix("sbatch: error: ") for line in (done.stderr or done.stdout).strip().splitlines()]
    return f"Slurm refuses it ({done.returncode}): {' '.join(said)[:300]}"


def _answer(stdout: str) -> dict | None:
    for line in reversed(stdout.splitlines()):
        if line.startswith("{"):
            try:
                return json.loads(line)
            except json.JSONDecodeError:
                return None
    return None


def main(argv: list[str]) -> int:
    folder, token, modules, *paths = argv
    here = Path(folder)
    seen = (here / FROM_LOGIN).exists() and (here / FROM_LOGIN).read_text() == token
    if seen:
        (here / FROM_NODE).write_text(token)
    unseen = [p for p in paths if not os.path.exists(p)]
    missing = [m for m in modules.split(",") if m and importlib.util.find_spec(m) is None]
    print(json.dumps({"node": socket.gethostname(), "read": seen, "unseen": unseen, "missing_modules": missing}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
