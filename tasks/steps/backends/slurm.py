"""A Slurm cluster: every step that computes runs whole as a Slurm job of its shape (how.resources); the orchestrating
process submits it (or follows the job an earlier orchestrator submitted), waits and reads what the job committed,
never computing. Inside the job, srun starts the step's ranks over the job's nodes (each bound to its GPUs), and a
fanning-out step's datatrove stages run as job arrays (tasks/steps/backends/slurm_arrays.py). Before anything is
submitted, validation asks for the cluster's machine checks (tasks/steps/backends/slurm_checks.py)."""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

from compass.infra.disk_full import disk_full_named, ended_on_a_full_disk
from compass.infra.exits import mark_retriable, trained_a_step
from compass.infra.layout import WorkFolder
from compass.infra.manifest import Execution
from compass.infra.net import free_port
from compass.infra.slurm import (
    SlurmJobFailed,
    ranks_command,
    read_record,
    request_for,
    run_on_slurm,
    run_ranks_step,
    state_of,
)
from compass.specs.base import Issue
from compass.specs.how import How, SlurmCluster
from compass.tasks.steps.backends.base import (
    Backend,
    Description,
    Log,
    MachineCheck,
    NotHere,
    Ranks,
    Stage,
    StageExecutor,
    T,
    WholeWork,
)
from compass.tasks.steps.backends.local import local_pool
from compass.tasks.steps.backends.slurm_arrays import ArrayStage
from compass.tasks.steps.backends.slurm_checks import slurm_machine_checks

RUNS_WHOLE = "a step placed as a Slurm job runs whole inside it (flows/runner.py), its ranks and stages included"


class SlurmBackend(Backend):
    modes = ("slurm_job", "in_slurm_job")

    @property
    def _inside(self) -> bool:
        return self.placement.mode == "in_slurm_job"

    def run_whole(self, work: WholeWork[T], how: How, log: Log) -> T:
        if self._inside:  # the job itself computes it
            return work.compute()
        cluster = _cluster(how)
        shape = self.placement.shape
        assert shape is not None, f"{work.what} computes nothing: it needs no job"
        work.workdir.mkdir(parents=True, exist_ok=True)
        tmp = work.job_file.with_suffix(".tmp")
        tmp.write_text(work.job_text(self.placement.inside_job()))
        tmp.rename(work.job_file)
        request = request_for(shape, cluster, how.hardware.accelerator, work.workdir,
                              (sys.executable, "-m", work.module, str(work.job_file)), work.label[:40],
                              fault_requeues=how.orchestration.retries)
        try:
            job_id = run_on_slurm(request, cluster, log, done=work.done, on_job=work.on_job)
        except SlurmJobFailed:
            with disk_full_named(work.what, work.workdir):  # the job ended on a full disk: the one message, no retry
                ended_on_a_full_disk(work.workdir)
            raise
        if not work.done():
            raise SlurmJobFailed(f"Slurm job {job_id} completed without committing {work.what}; see "
                                 f"{WorkFolder(work.workdir).slurm_log}")
        return work.collect()

    def start_ranks(self, ranks: Ranks, how: How, log: Log) -> int:
        if not self._inside:
            raise NotHere(f"{ranks.module}: {RUNS_WHOLE}")
        nodes = ranks.hardware.nodes
        port = ranks.hardware.rendezvous_port if nodes > 1 else free_port()
        cluster = how.orchestration.cluster
        argv = ranks_command(["-m", ranks.module, str(ranks.job_path)], sys.executable, nodes, ranks.world // nodes,
                             port, cluster.launch if cluster else "srun", gpus=ranks.hardware.accelerator != "cpu")
        log.info("starting %d ranks on %d node(s): %s", ranks.world, nodes, " ".join(argv[:-1]))
        ended = run_ranks_step(argv, ranks.job_path.parent)
        if ended.code and ended.unlaunched:  # a node lost after the job began: a requeued job finds it back
            mark_retriable(ranks.job_path.parent, "launch",
                           "srun could not start the ranks on " + "; ".join(ended.unlaunched), ended.unlaunched_nodes)
        if ended.code and ended.signalled and trained_a_step(ranks.job_path.parent):
            # a rank a signal ended after the step made progress (NCCL's watchdog abort, a kill, a bus error): the
            # same code ran before, so the fault is the node's or the fabric's; before any progress it is the
            # code's or the spec's, and requeueing would only repeat it
            mark_retriable(ranks.job_path.parent, "signal",
                           "a rank died by a signal after the step made progress: " + "; ".join(ended.signalled),
                           (ended.first_signalled_node,) if ended.first_signalled_node else ())
        return ended.code

    def stage_executor(self, stage: Stage, how: How, log: Log) -> StageExecutor:
        if not self._inside:
            raise NotHere(f"{stage.name}: {RUNS_WHOLE}")
        if self.placement.tasks is not None:  # a fanning-out step's driver job: its stages are job arrays
            return ArrayStage(stage, self.placement.tasks, _cluster(how), log)
        return local_pool(stage, self.placement.shape, how)  # the job's own CPUs

    def machine_checks(self, check: MachineCheck) -> Iterator[Issue]:
        return slurm_machine_checks(check)

    def describe(self, how: How) -> Description:
        cluster = _cluster(how)
        shape = self.placement.tasks or self.placement.shape
        assert shape is not None
        if self.placement.tasks is not None:
            runs = "Slurm jobs; curation and tokenization as job arrays of 1-CPU tasks"
        else:
            runs = "Slurm job" + (", whole nodes" if shape.whole_nodes and not shape.cpus_per_node else "")
        if shape.partition != cluster.partition:
            runs += f" on partition {shape.partition}"
        asks = {"account": cluster.account, "qos": cluster.qos, "constraint": cluster.constraint,
                "exclude": ",".join(cluster.exclude) or None, "time limit": cluster.time_limit}
        settings = (
            ("near a job's time limit",
             f"USR1 {cluster.signal_before_s} s before it: checkpoint, requeue and resume" if cluster.requeue
             else "no signal (requeue off): the job ends at its limit; a retry resumes from its newest checkpoint"),
            ("Slurm options", ", ".join(f"{k} {v}" for k, v in asks.items() if v) or "none"),
            ("job state read every", f"{cluster.poll_seconds:g} s (the probe waits {cluster.probe_timeout_s} s)"))
        note = (f"Slurm jobs on partition {cluster.partition or '(default)'}, work folders under "
                f"{cluster.shared_root}; ranks start with {cluster.launch}")
        return Description(runs_as=runs, launch=f"Slurm, launch {cluster.launch}", notes=(note,),
                           places_devices="Slurm", settings=settings)

    def execution(self) -> Execution:
        record = super().execution()
        if not self._inside:
            return record
        return record.model_copy(update={"slurm_job": os.environ.get("SLURM_JOB_ID"),
                                         "node_list": os.environ.get("SLURM_JOB_NODELIST")})


def _cluster(how: How) -> SlurmCluster:
    cluster = how.orchestration.cluster
    if cluster is None:
        raise NotHere("a Slurm placement under a `how` without how.orchestration.cluster")
    return cluster


def stale_work(workdir: Path) -> bool:
    """A committed step's work folder that a Slurm job of an earlier run may have left (its orchestrator died while
    the job finished): True when it can go, unless a job is still at work in it. Whatever placed the step then, not
    the placement it would get now: a folder a live job still writes its log into is never removed."""
    if not WorkFolder(workdir).step_job.exists():
        return False
    record = read_record(workdir)
    state = state_of(record.job_id) if record and shutil.which("scontrol") else None
    return state is None or not state.live
