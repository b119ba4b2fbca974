"""This machine: the orchestrating process computes the step (one rank, or bookkeeping), and starts a step's ranks
with torchrun or DeepSpeed's launcher (over ssh to how.hardware.hosts for several nodes); a datatrove stage runs in
datatrove's local pool with the phase's CPUs (a small one in this process)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

import multiprocess

from compass.infra.die_with_parent import children_die_with_this_thread, parent_death_preexec
from compass.infra.launcher import TRAINER_MODULE, plan_launch
from compass.infra.layout import WorkFolder
from compass.infra.net import free_port
from compass.model.attention import flash_kernel
from compass.specs.base import Issue
from compass.specs.how import How, Shape
from compass.specs.spec import TrainingSpec
from compass.tasks.steps.backends.base import (
    SMOKE_HINT,
    Backend,
    Description,
    Log,
    MachineCheck,
    Ranks,
    Stage,
    StageExecutor,
    T,
    WholeWork,
)

# datatrove runs a local stage of one worker in the calling process, and each of its ranks resets loguru's global
# sinks to its own task log: two such stages on parallel step threads would write into each other's logs.
_IN_PROCESS = threading.Lock()
# What a local stage's pool workers import to run the data steps' pipelines, imported once by the forkserver that
# forks them: every worker of every later stage starts with them loaded (each paid ~0.5 s of imports per stage).
# Light on purpose: no torch, no transformers.
WORKER_MODULES = ("compass.infra.forkserver_preload", "compass.tasks.steps.backends.executors",
                  "compass.tasks.data.curate_blocks", "compass.tasks.data.source_reader",
                  "compass.tasks.data.token_shards", "compass.tasks.data.fence_blocks",
                  "compass.tasks.data.written_files", "compass.model.training.token_files",
                  "datatrove.pipeline.readers", "datatrove.pipeline.dedup", "tokenizers")
NO_CLUSTER = "no cluster: every step computes on this machine"


class LocalBackend(Backend):
    modes = ("in_process", "local_ranks")

    def run_whole(self, work: WholeWork[T], how: How, log: Log) -> T:
        return work.compute()

    def start_ranks(self, ranks: Ranks, how: How, log: Log) -> int:
        nodes, hosts = ranks.hardware.nodes, ranks.hardware.hosts
        if nodes > 1 and not hosts:  # a spec may be planned and costed without them, not launched
            raise ValueError(f"{nodes} nodes but how.hardware.hosts is empty: list the nodes' addresses, the "
                             "rendezvous host first")
        workdir = ranks.job_path.parent
        plan = plan_launch(ranks.job_path, world=ranks.world, nodes=nodes, hosts=hosts, launcher=ranks.launcher,
                           port=ranks.hardware.rendezvous_port if nodes > 1 else free_port(), python=sys.executable,
                           cwd=workdir, module=ranks.module)
        if plan.hostfile:
            WorkFolder(workdir).hostfile.write_text(plan.hostfile)
        for command in plan.commands:
            log.info("launching on %s: %s", command.host, command)
        _run_all(plan, workdir, "training" if ranks.module == TRAINER_MODULE else ranks.module)
        return 0

    def stage_executor(self, stage: Stage, how: How, log: Log) -> StageExecutor:
        return local_pool(stage, self.placement.shape, how)

    def machine_checks(self, check: MachineCheck) -> Iterator[Issue]:
        if not check.rehearsal:  # a rehearsal's CPU ranks stand in for the GPUs: the kernels are theirs to check
            yield from kernels_here(check.spec)

    def describe(self, how: How) -> Description:
        shape = self.placement.shape
        ranks = shape.ranks if shape else 1
        return Description(runs_as=f"{ranks} ranks (torchrun)" if ranks > 1 else "this process",
                           launch=how.hardware.launcher, notes=(NO_CLUSTER,),
                           places_devices="Ray" if how.orchestration.task_runner == "ray" else None)


class TiedExecutor:
    """A datatrove executor run with the step's child processes tied to its thread (datatrove's Manager too), under
    `lock` when one is given."""

    def __init__(self, executor, lock: threading.Lock | None = None):
        self.executor, self.lock = executor, lock

    def run(self) -> None:
        with self.lock or contextlib.nullcontext(), children_die_with_this_thread():
            self.executor.run()

    def get_incomplete_ranks(self, ranks: Iterable[int] | None = None,
                             skip_completed: bool | None = None) -> list[int]:
        return self.executor.get_incomplete_ranks(ranks, skip_completed=skip_completed)


def local_pool(stage: Stage, shape: Shape | None, how: How) -> StageExecutor:
    """A stage on this machine's CPUs (the phase's, or how.orchestration.workers), in this process when its work
    is under how.orchestration.in_process_below_mib."""
    from compass.tasks.steps.backends.executors import LocalExecutor

    orch = how.orchestration
    multiprocess.set_forkserver_preload(list(WORKER_MODULES))  # forkserver_preload: workers die with the run
    workers = shape.cpus_per_node if shape and shape.cpus_per_node else orch.workers
    if stage.work_bytes is not None and stage.work_bytes < orch.in_process_below_mib * 2**20:
        workers = 1
    workers = min(stage.tasks, workers)
    executor = LocalExecutor(stage.pipeline, tasks=stage.tasks, workers=workers, logging_dir=str(stage.logging_dir),
                             skip_completed=True)
    return TiedExecutor(executor, _IN_PROCESS if workers == 1 else None)


def kernels_here(spec: TrainingSpec) -> Iterator[Issue]:
    """The steps compute on this machine: CUDA for GPUs and the GPU extras the spec names. Torch is imported only to
    check what the spec asks of it (it took 3 of `compass validate`'s 5.6 s on a CPU spec)."""
    how = spec.how
    accelerator = how.hardware.accelerator
    if accelerator != "cpu":
        import torch

        if not torch.cuda.is_available():
            yield Issue(("how", "hardware", "accelerator"), f"the spec trains on {accelerator} GPUs and this machine "
                        "has no CUDA device", f"run it where the GPUs are, {SMOKE_HINT}")
    if how.attention == "flash" and flash_kernel() is None:
        yield Issue(("how", "attention"), "flash attention needs the flash-attn package, not installed here",
                    "pip install 'compass-lifecycle[gpu]' on the GPU nodes, or attention: auto")
    if how.loss == "liger" and not _liger_available():
        yield Issue(("how", "loss"), "the liger loss needs CUDA and the liger-kernel package",
                    "pip install 'compass-lifecycle[gpu]' on the GPU nodes, or loss: auto")


def _liger_available() -> bool:
    from compass.model.loss import liger_available

    return liger_available()


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
