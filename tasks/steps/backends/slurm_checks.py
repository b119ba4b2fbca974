"""What a Slurm cluster must offer before anything is submitted: its commands on this machine's PATH, a controller
that answers and knows the partitions the spec names, and a probe job on a compute node of each partition the jobs
go to, proving the nodes see the shared root, the local store and data and the Hugging Face cache's snapshots the
steps read (and import the CUDA-only kernels the spec names, on the GPU nodes): compass.infra.shared_probe."""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from compass.infra.shared_probe import ProbeResult, refusal, verified
from compass.infra.slurm import cluster_setting
from compass.specs.base import Issue, Loc
from compass.specs.checks import phases_of
from compass.specs.file_stamp import hub_cache
from compass.specs.how import PHASES, Phase, SlurmCluster
from compass.specs.spec import TrainingSpec
from compass.tasks.steps.backends.base import SMOKE_HINT, MachineCheck, NotHere


def slurm_machine_checks(check: MachineCheck) -> Iterator[Issue]:
    """The cluster's commands, controller and partitions, then (once they answer) the probe jobs. Nothing here
    imports torch: this machine only plans, submits and follows."""
    how = check.spec.how
    cluster = how.orchestration.cluster
    if cluster is None:
        raise NotHere("the Slurm checks of a spec without how.orchestration.cluster")
    missing = [c for c in ("sbatch", "scontrol", "scancel") if shutil.which(c) is None]
    if missing:
        yield Issue(("how", "orchestration", "cluster"), f"the spec runs its steps as Slurm jobs and "
                    f"{', '.join(missing)} {'is' if len(missing) == 1 else 'are'} not on this machine's PATH",
                    f"run compass on a Slurm login node, {SMOKE_HINT}")
        return
    reachable = list(slurm_partition(cluster.partition, SMOKE_HINT))
    for phase in PHASES:  # a phase's own partition, where the spec names one
        named = getattr(how.resources, phase).partition
        if not reachable and named:
            reachable += slurm_partition(named, SMOKE_HINT, ("how", "resources", phase, "partition"))
    yield from reachable
    if not reachable and cluster.shared_root and check.writes:
        yield from _shared_paths(check, gpu_extras=not check.rehearsal)


def slurm_partition(partition: str | None, smoke_hint: str,
                     at: tuple[str, ...] = ("how", "orchestration", "cluster", "partition")) -> Iterator[Issue]:
    """The Slurm controller answers, and knows the partition the spec names (at `at`)."""

    command = ["sinfo", "-h", "-o", "%P"] + (["-p", partition] if partition else [])
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired) as exc:
        done = subprocess.CompletedProcess(command, 1, "", str(exc))
    if done.returncode:
        yield Issue(("how", "orchestration", "cluster"), "the spec runs its steps as Slurm jobs and this machine's "
                    f"Slurm controller does not answer ({_first_line(done.stderr or done.stdout)})",
                    f"run compass on a Slurm login node (or set SLURM_CONF), {smoke_hint}")
    elif partition and not done.stdout.strip():
        yield Issue(at, f"Slurm has no partition '{partition}'", "name one that `sinfo` lists")


def _shared_paths(check: MachineCheck, gpu_extras: bool = True) -> Iterator[Issue]:
    """A probe job on a compute node proves the shared root is shared, and that the nodes see the local store, the
    local data and the Hugging Face cache's snapshots the steps read (compass.infra.shared_probe); nothing else is
    submitted until it does. With
    `gpu_extras`, also that the nodes import the CUDA-only kernels the spec names (on the GPU nodes). Each partition
    the jobs go to is probed, with and without a GPU as the jobs there ask (probed_partitions)."""

    spec = check.spec
    cluster = spec.how.orchestration.cluster
    assert cluster is not None and cluster.shared_root is not None
    wanted = check.node_paths()
    how = spec.how
    modules = {"flash_attn": ("how", "attention")} if how.attention == "flash" and gpu_extras else {}
    modules |= {"liger_kernel": ("how", "loss")} if how.loss == "liger" and gpu_extras else {}
    for ask in probed_partitions(spec):
        result = verified(cluster, list(wanted), list(modules) if ask.gpus or how.hardware.accelerator == "cpu" else [],
                          partition=ask.partition, gpus=ask.gpus, cluster_name=cluster_setting("ClusterName"))
        yield from _probe_issues(result, cluster, wanted, modules, ask)
        if ask.without_gpu and not result.problem:  # the same partition's jobs that ask none: taken there?
            refused = refusal(cluster, ask.partition)
            if refused:
                yield _refused(refused, ProbeAsk(ask.partition, 0, ask.without_gpu))


@dataclass(frozen=True)
class ProbeAsk:
    """One probe job's request: a partition (None: the cluster's default), GPUs or none, as the jobs of `phases`
    ask there; `without_gpu`, the phases of the same partition whose jobs ask no GPU when the probe asks one."""

    partition: str | None
    gpus: int
    phases: tuple[Phase, ...]
    without_gpu: tuple[Phase, ...] = ()


def probed_partitions(spec: TrainingSpec) -> list[ProbeAsk]:
    """What the spec's jobs ask for, as probes: one probe job per partition they go to, with a GPU where phases
    there ask for GPUs (the GPU nodes the training needs are the ones proven to see the shared root). The phases of
    that partition that ask no GPU are asked of the controller alone (`sbatch --test-only`): a site may refuse such
    jobs on its GPU partitions, and its data jobs are then refused here, before anything is submitted."""
    how = spec.how
    asked: dict[str | None, dict[int, list[Phase]]] = {}
    for phase in sorted(phases_of(spec), key=PHASES.index):
        shape = how.shape(phase)
        gpus = 1 if how.hardware.accelerator != "cpu" and shape.devices_per_node else 0
        asked.setdefault(shape.partition, {}).setdefault(gpus, []).append(phase)
    default = how.orchestration.cluster.partition if how.orchestration.cluster else None
    return [ProbeAsk(partition, 1, tuple(by[1]), tuple(by.get(0, ()))) if 1 in by else
            ProbeAsk(partition, 0, tuple(by[0])) for partition, by in asked.items()] or [ProbeAsk(default, 0, ())]


def _refused(problem: str, ask: ProbeAsk) -> Issue:
    """A partition that did not take (or would not take) the one-task job the phases of `ask` ask for."""
    where = f"partition {ask.partition}" if ask.partition else "the default partition"
    phase = ask.phases[0] if ask.phases else "data"
    asked = "with a GPU" if ask.gpus else "without a GPU"
    phases = ", ".join(ask.phases) or phase
    return Issue(("how", "resources", phase, "partition"),
                 f"{problem}: {where} did not take a one-task job {asked}, as the {phases} jobs ask",
                 f"give the phase a partition that takes such jobs (how.resources.{phase}.partition: e.g. a "
                 "CPU partition for data where GPU partitions take only jobs that ask for GPUs), or free a node")


def _probe_issues(result: ProbeResult, cluster: SlurmCluster, wanted: dict[str, tuple[Loc, str]],
                  modules: dict[str, tuple[str, ...]], ask: ProbeAsk) -> Iterator[Issue]:
    """What a probe of one partition found, each at the spec field to change."""
    at = ("how", "orchestration", "cluster", "shared_root")
    hint = "set shared_root to a folder every compute node mounts at the same path (Lustre, GPFS, NFS, FSx)"
    if result.problem and "did not run" in result.problem and "No such file" in result.problem:
        yield Issue(("how", "orchestration", "cluster"), f"{result.problem}: the compute nodes do not see this "
                    f"Python ({sys.executable})", "install compass in a virtual environment under the shared root "
                    "(or an image every node has) and run compass from it")
    elif result.problem and "did not run" in result.problem:
        yield _refused(result.problem, ask)
    elif result.problem:
        yield Issue(at, result.problem, hint)
    for module in result.missing_modules:
        yield Issue(modules[module], f"{module} is not installed on compute node {result.node} (the spec's "
                    f"{modules[module][-1]} needs it)", "pip install 'compass-lifecycle[gpu]' in the nodes' "
                    "environment, or choose auto")

    for path in result.unseen:
        loc, what = wanted[path]
        fix = (f"set HF_HUB_CACHE to a folder under how.orchestration.cluster.shared_root ({cluster.shared_root}) "
               f"and copy the cache ({hub_cache()}) there" if Path(path).is_relative_to(hub_cache()) else
               f"move it under how.orchestration.cluster.shared_root ({cluster.shared_root}) or onto S3")
        yield Issue(loc, f"{what} is not visible on compute node {result.node}: the steps' jobs could not read it",
                    fix)


def _first_line(text: str) -> str:
    return next((line.strip() for line in text.splitlines() if line.strip()), "no output")[:160]
