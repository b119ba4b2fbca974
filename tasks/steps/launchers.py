"""How work starts where its placement puts it: one launcher per placement mode, as datatrove has one executor per
backend. tasks/steps/placement.py decides the mode; everything that acts on it (the runner, the ranks of the
trainer, TRL and lighteval, the executor of a datatrove stage, the manifest's execution record) asks the step's
launcher (`launcher_for(placement)`) and never reads the mode itself.

- InProcess: this process computes the step (one rank, or bookkeeping; several started as LocalRanks does);
- LocalRanks: this machine starts the step's ranks with torchrun or DeepSpeed's launcher (over ssh to
  how.hardware.hosts for several nodes);
- RayTasks: a data step whose datatrove stages run as Ray tasks;
- SlurmJob: a Slurm job computes the step whole; this process submits, follows and reads what it committed;
- InSlurmJob: what the step sees inside that job: srun starts its ranks over the job's nodes, and a fanning-out
  step's stages run as Slurm job arrays.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import ClassVar, Literal

from compass.infra.die_with_parent import parent_death_preexec
from compass.infra.exits import mark_retriable
from compass.infra.launcher import TRAINER_MODULE, plan_launch
from compass.infra.layout import WorkFolder
from compass.infra.manifest import Execution
from compass.infra.net import free_port
from compass.infra.slurm import ranks_command, run_ranks_step
from compass.specs.how import Hardware, SlurmCluster
from compass.tasks.steps.placement import Mode, Placement

StageBackend = Literal["local", "ray", "slurm_arrays"]  # what runs a datatrove stage's ranks
Log = logging.Logger | logging.LoggerAdapter


class Launcher:
    """The placement's way of starting work. `computes_here`: this process runs the step (and imports what its
    kind needs); `stages`: what runs its datatrove stages; `start_ranks`: its training or library ranks."""

    mode: ClassVar[Mode]
    computes_here: ClassVar[bool] = True

    def __init__(self, placement: Placement):
        self.placement = placement

    @property
    def stages(self) -> StageBackend:
        """A fanning-out step under a cluster (placement.tasks): job arrays; anything else: this machine's CPUs."""
        return "slurm_arrays" if self.placement.tasks is not None else "local"

    @property
    def holds_devices(self) -> bool:
        """It holds this machine's devices (GPUs, or training ranks on CPU) while it runs: such steps take turns
        (the `gpu` tag's concurrency limit). A Slurm job's devices are Slurm's to share out."""
        return False

    def ray_resources(self, accelerator: str) -> dict[str, float] | None:
        """What the Prefect task computing the step on Ray asks Ray for (None: Ray's default)."""
        shape = self.placement.shape
        if self.holds_devices and shape is not None and accelerator != "cpu":
            return {"num_gpus": shape.devices_per_node}
        return None

    def start_ranks(self, module: str, job_path: Path, world: int, hardware: Hardware, cluster: SlurmCluster | None,
                    log: Log, launcher: str = "torchrun") -> int:
        """Start `world` ranks of `python -m module job_path` (working folder: the job file's) over
        `hardware.nodes` nodes and wait for them; their exit status (0: every rank ended well)."""
        raise RuntimeError(f"a step placed {self.mode} starts no ranks of its own")

    def execution(self) -> Execution:
        """Where this execution ran, for the manifest: the mode and the shape."""
        shape = self.placement.shape
        return Execution(mode=self.mode, nodes=shape.nodes if shape else 1,
                         devices_per_node=shape.devices_per_node if shape else 0)


class LocalRanks(Launcher):
    mode = "local_ranks"

    @property
    def holds_devices(self) -> bool:
        return bool(self.placement.shape and self.placement.shape.devices_per_node)

    def start_ranks(self, module: str, job_path: Path, world: int, hardware: Hardware, cluster: SlurmCluster | None,
                    log: Log, launcher: str = "torchrun") -> int:

        nodes, hosts = hardware.nodes, hardware.hosts
        if nodes > 1 and not hosts:  # a spec may be planned and costed without them, not launched
            raise ValueError(f"{nodes} nodes but how.hardware.hosts is empty: list the nodes' addresses, the "
                             "rendezvous host first")
        workdir = job_path.parent
        plan = plan_launch(job_path, world=world, nodes=nodes, hosts=hosts, launcher=launcher,  # type: ignore[arg-type]
                           port=hardware.rendezvous_port if nodes > 1 else free_port(), python=sys.executable,
                           cwd=workdir, module=module)
        if plan.hostfile:
            WorkFolder(workdir).hostfile.write_text(plan.hostfile)
        for command in plan.commands:
            log.info("launching on %s: %s", command.host, command)
        _run_all(plan, workdir, "training" if module == TRAINER_MODULE else module)
        return 0


class InProcess(LocalRanks):
    """This process computes the step; a job handed it with several ranks (a trainer run directly, outside a plan)
    starts them here as LocalRanks does."""

    mode = "in_process"


class RayTasks(Launcher):
    mode = "ray_tasks"

    @property
    def stages(self) -> StageBackend:
        return "ray"

    def ray_resources(self, accelerator: str) -> dict[str, float] | None:
        return {"num_cpus": 0}  # its driver only waits: the stages' Ray tasks hold the CPUs


class SlurmJob(Launcher):
    mode = "slurm_job"
    computes_here = False


class InSlurmJob(Launcher):
    mode = "in_slurm_job"

    def start_ranks(self, module: str, job_path: Path, world: int, hardware: Hardware, cluster: SlurmCluster | None,
                    log: Log, launcher: str = "torchrun") -> int:

        nodes = hardware.nodes
        port = hardware.rendezvous_port if nodes > 1 else free_port()
        argv = ranks_command(["-m", module, str(job_path)], sys.executable, nodes, world // nodes, port,
                             cluster.launch if cluster else "srun", gpus=hardware.accelerator != "cpu")
        log.info("starting %d ranks on %d node(s): %s", world, nodes, " ".join(argv[:-1]))
        ended = run_ranks_step(argv, job_path.parent)
        if ended.code and ended.unlaunched:  # a node lost after the job began: a requeued job finds it back
            mark_retriable(job_path.parent, "launch",
                           "srun could not start the ranks on " + "; ".join(ended.unlaunched))
        return ended.code

    def execution(self) -> Execution:
        return super().execution().model_copy(update={"slurm_job": os.environ.get("SLURM_JOB_ID"),
                                                      "node_list": os.environ.get("SLURM_JOB_NODELIST")})


LAUNCHERS: dict[str, type[Launcher]] = {cls.mode: cls for cls in (InProcess, LocalRanks, RayTasks, SlurmJob,
                                                                 InSlurmJob)}


def launcher_for(placement: Placement) -> Launcher:
    return LAUNCHERS[placement.mode](placement)


def _run_all(plan, workdir: Path, what: str) -> None:
    """Start every node's launcher, wait for all; one failing stops the others (they would wait forever)."""
    work = WorkFolder(workdir)
    logs = [open(work.launcher_log(i), "w") for i in range(len(plan.commands))]  # noqa: SIM115

    tied = parent_death_preexec()  # a killed step takes its launchers (and, through them, its ranks) with it
    procs = [subprocess.Popen(c.argv, cwd=workdir, stdout=f, stderr=subprocess.STDOUT,
                              env={**os.environ, **plan.env}, preexec_fn=tied)
             for c, f in zip(plan.commands, logs, strict=True)]
    try:
        while True:
            codes = [p.poll() for p in procs]
            failed = next((i for i, code in enumerate(codes) if code not in (None, 0)), None)
            if failed is not None or all(code == 0 for code in codes):
                break
            time.sleep(0.2)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for f in logs:
            f.close()
    if failed is not None:
        tail = work.launcher_log(failed).read_text()[-3000:]
        raise RuntimeError(f"{what} failed on {plan.commands[failed].host} "
                           f"({procs[failed].returncode}); last output:\n{tail}")
