"""Launch commands for multi-process training: torchrun per node, or DeepSpeed's launcher with a hostfile.

Every rank runs `python -m model.trainer JOB.json`; what differs is how the processes find each other. The
commands are built here from `how.hardware` (nodes, devices per node, hosts, launcher, rendezvous port) so
they can be read in a step's log, checked in tests, and run unchanged by hand on a cluster.
"""

from __future__ import annotations

import shlex
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

TRAINER_MODULE = "compass.model.training.trainer"
Launcher = Literal["torchrun", "deepspeed"]


@dataclass(frozen=True)
class NodeCommand:
    host: str
    argv: list[str]

    def __str__(self) -> str:
        return shlex.join(self.argv)


@dataclass(frozen=True)
class LaunchPlan:
    """What to start: one command per node for torchrun, one on the head node for DeepSpeed (it reaches the
    others itself through pdsh), and DeepSpeed's hostfile."""

    commands: list[NodeCommand]
    hostfile: str | None = None
    env: dict[str, str] = field(default_factory=dict)


def is_local(host: str) -> bool:
    return host in {"127.0.0.1", "localhost", "::1", socket.gethostname(), socket.getfqdn()}


def plan_launch(job_path: Path, *, world: int, nodes: int, hosts: list[str], launcher: Launcher, port: int,
                python: str, cwd: Path, hostfile_path: Path | None = None,
                module: str = TRAINER_MODULE) -> LaunchPlan:
    """Commands that start `world` ranks of `python -m module job_path` over `nodes` nodes (hosts[0] hosts the
    rendezvous)."""
    if world % nodes:
        raise ValueError(f"{world} ranks cannot be spread evenly over {nodes} nodes")
    per_node = world // nodes
    hosts = hosts or ["127.0.0.1"] * nodes
    if len(hosts) != nodes:
        raise ValueError(f"how.hardware.hosts names {len(hosts)} hosts for {nodes} nodes")
    head = hosts[0]
    if launcher == "deepspeed":
        hostfile = "".join(f"{h} slots={per_node}\n" for h in hosts)
        path = hostfile_path or job_path.with_name("hostfile")
        argv = [python, "-m", "deepspeed.launcher.runner", "--hostfile", str(path), "--master_addr", head,
                "--master_port", str(port), "--num_nodes", str(nodes), "--num_gpus", str(per_node),
                "--module", module, str(job_path)]
        return LaunchPlan([NodeCommand(head, _on(head, argv, cwd))], hostfile=hostfile)
    commands = []
    for rank, host in enumerate(hosts):
        argv = [python, "-m", "torch.distributed.run", "--nnodes", str(nodes), "--node-rank", str(rank),
                "--nproc-per-node", str(per_node), "--master-addr", head, "--master-port", str(port),
                "-m", module, str(job_path)]
        commands.append(NodeCommand(host, _on(host, argv, cwd)))
    return LaunchPlan(commands)


def _on(host: str, argv: list[str], cwd: Path) -> list[str]:
    """The command as run on `host`: directly when it is this machine, else over ssh in the same folder
    (the nodes share the code and the step's work folder at the same paths)."""
    if is_local(host):
        return argv
    return ["ssh", "-o", "BatchMode=yes", "--", host, f"cd {shlex.quote(str(cwd))} && {shlex.join(argv)}"]
