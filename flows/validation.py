"""Validation: what a spec needs beyond its own rules, checked before anything runs or is written.

The loader (compass.specs) checks the spec alone. Here come the checks that need the rest of compass or the
machine: the compiled plan (every checkpoint a spec names exists, every step kind it times out is one), and
each step kind's own machine checks (local paths, installed libraries' signatures, cached hub objects, datasets).
Problems come back like the loader's, as `file:line: field: what (hint)`, all at once.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, replace
from pathlib import Path

from compass.flows.compiler import Plan, PlanError, compile_spec
from compass.flows.server.confinement import local_paths
from compass.infra.environment import hub_cache
from compass.infra.shared_probe import ProbeResult, refusal, verified
from compass.model.attention import flash_kernel
from compass.specs import costs
from compass.specs.base import Issue
from compass.specs.checks import check_spec, phases_of
from compass.specs.file_stamp import s3_credentials_here
from compass.specs.how import PHASES, Phase, SlurmCluster
from compass.specs.loader import LoadedSpec, SpecError, load_spec, load_spec_text
from compass.specs.smoke import Shrink, Size, shrunk_spec
from compass.specs.spec import TrainingSpec
from compass.tasks.steps import registry


@dataclass(frozen=True)
class CheckedSpec:
    """A spec that passed every check, with its compiled plan."""

    loaded: LoadedSpec
    plan: Plan

    @property
    def spec(self) -> TrainingSpec:
        return self.loaded.spec


def check(loaded: LoadedSpec, machine: bool = True) -> CheckedSpec:
    """Compile the plan and run every kind's checks; SpecError lists all problems found. `machine=False` leaves out
    what depends on the machine it runs on (GPUs, GPU extras, memory, credentials, local paths, the Hugging Face
    cache): for checking a spec alone, or planning a cluster's run from a laptop."""
    issues = list(_step_kind_names(loaded.spec))
    if machine or loaded.spec.how.hardware.accelerator != "cpu":  # a GPU's memory is its kind's, wherever it runs
        issues += _memory(loaded.spec)
    if machine:
        issues += _machine(loaded.spec, loaded.base_dir, rehearsal=loaded.size == "rehearsal")
    for kind in registry.kinds():
        if kind.check_spec is not None:
            issues += kind.check_spec(loaded.spec, loaded.base_dir)
        if machine and kind.check_machine is not None:
            issues += kind.check_machine(loaded.spec, loaded.base_dir)
    plan = None
    try:
        plan = compile_spec(loaded.spec)
    except PlanError as exc:
        issues += exc.issues
    if issues or plan is None:
        raise SpecError(loaded.problems(issues))
    return CheckedSpec(loaded, plan)


def load_checked(path: str | Path, machine: bool = True, size: Size = "full") -> CheckedSpec:
    loaded = load_spec(path)
    return check(shrunk(loaded, size), machine)


def load_checked_text(text: str, filename: str = "<spec>", base_dir: Path | None = None, machine: bool = True,
                      size: Size = "full") -> CheckedSpec:
    loaded = load_spec_text(text, filename, base_dir)
    return check(shrunk(loaded, size), machine)


_CHECKED_FOR_THIS_RUN: ContextVar[CheckedSpec | None] = ContextVar("compass_checked_for_this_run", default=None)


@contextmanager
def checked_for_this_run(checked: CheckedSpec) -> Iterator[None]:
    """`compass run` hands the spec it loaded and checked to the flow it starts in this process, which takes it
    instead of loading and checking it a second time (local source folders listed again, the Hugging Face cache and
    S3 asked again). A flow run a worker starts has none and checks the spec on its own machine."""
    token = _CHECKED_FOR_THIS_RUN.set(checked)
    try:
        yield
    finally:
        _CHECKED_FOR_THIS_RUN.reset(token)


def checked_already(text: str, base_dir: Path, size: Size) -> CheckedSpec | None:
    """The spec `checked_for_this_run` holds, if it is this text at this size from this folder."""
    held = _CHECKED_FOR_THIS_RUN.get()
    if held is None or held.loaded.text != text or held.loaded.size != size or held.loaded.base_dir != base_dir:
        return None
    return held


def shrunk(loaded: LoadedSpec, size: Size) -> LoadedSpec:
    """The spec at smoke or rehearsal size (compass.specs.smoke); problems still point at the lines of the spec
    file."""
    from compass.tasks.kinds.select_tokenizer import with_cached_vocabularies

    if size == "full":
        return loaded
    small, changes = shrunk_spec(loaded.spec, size)
    small, stand_ins = with_cached_vocabularies(small)  # a small run uses the tokenizer this machine has cached
    changes += [Shrink("what.tokenizer", f"candidates[{i}].vocab_size", declared, f"{cached} (the cached tokenizer's)")
                for i, declared, cached in stand_ins]
    result = replace(loaded, spec=small, size=size, size_changes=tuple(changes))
    issues = check_spec(small)
    if issues:
        raise SpecError(result.problems(issues))
    return result


SMOKE_HINT = "or exercise the spec on this CPU first: compass run SPEC --smoke"


def _slurm_partition(partition: str | None, smoke_hint: str,
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


def _shared_paths(spec: TrainingSpec, base_dir: Path, gpu_extras: bool = True) -> Iterator[Issue]:
    """A probe job on a compute node proves the shared root is shared, and that the nodes see the local store, the
    local data and the Hugging Face cache's snapshots the steps read (compass.infra.shared_probe); nothing else is
    submitted until it does. With
    `gpu_extras`, also that the nodes import the CUDA-only kernels the spec names (on the GPU nodes). Each partition
    the jobs go to is probed, with and without a GPU as the jobs there ask (probed_partitions)."""

    cluster = spec.how.orchestration.cluster
    assert cluster is not None and cluster.shared_root is not None
    wanted: dict[str, tuple[tuple[str | int, ...], str]] = {}
    root = spec.how.storage.root_at(base_dir)
    if "://" not in root:  # the nearest folder that exists: the store itself may be created by the first run
        folder = Path(root)
        while not folder.exists() and folder != folder.parent:
            folder = folder.parent
        wanted[str(folder)] = (("how", "storage", "root"), f"the store {root} ({folder})")
    for loc, uri, path in local_paths(spec, base_dir):
        if path.exists():
            wanted[str(path)] = (loc, f"{uri} ({path})")
    for kind in registry.kinds():  # the Hugging Face cache's snapshots the steps read (tokenizers, datasets, models)
        for needed in kind.node_files(spec) if kind.node_files else ():
            wanted[str(needed.path)] = (needed.loc, f"{needed.what} ({needed.path})")
    how = spec.how
    modules = {"flash_attn": ("how", "attention")} if how.attention == "flash" and gpu_extras else {}
    modules |= {"liger_kernel": ("how", "loss")} if how.loss == "liger" and gpu_extras else {}
    for ask in probed_partitions(spec):
        result = verified(cluster, list(wanted), list(modules) if ask.gpus or how.hardware.accelerator == "cpu" else [],
                          partition=ask.partition, gpus=ask.gpus)
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


def _probe_issues(result: ProbeResult, cluster: SlurmCluster, wanted: dict[str, tuple[tuple[str | int, ...], str]],
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


def _kernels_here(spec: TrainingSpec) -> Iterator[Issue]:
    """Without a cluster the steps compute on this machine: CUDA for GPUs and the GPU extras the spec names. Torch
    is imported only to check what the spec asks of it (it took 3 of `compass validate`'s 5.6 s on a CPU spec)."""
    how = spec.how
    accelerator = how.hardware.accelerator
    if accelerator != "cpu":
        import torch

        if not torch.cuda.is_available():
            yield Issue(("how", "hardware", "accelerator"), f"the spec trains on {accelerator} GPUs and this machine "
                        "has no CUDA device", f"run it where the GPUs are, {SMOKE_HINT}")
    if how.attention == "flash" and _flash_kernel() is None:
        yield Issue(("how", "attention"), "flash attention needs the flash-attn package, not installed here",
                    "pip install 'compass-lifecycle[gpu]' on the GPU nodes, or attention: auto")
    if how.loss == "liger" and not _liger_available():
        yield Issue(("how", "loss"), "the liger loss needs CUDA and the liger-kernel package",
                    "pip install 'compass-lifecycle[gpu]' on the GPU nodes, or loss: auto")


def _flash_kernel():

    return flash_kernel()


def _liger_available() -> bool:
    from compass.model.loss import liger_available

    return liger_available()


def _first_line(text: str) -> str:
    return next((line.strip() for line in text.splitlines() if line.strip()), "no output")[:160]


def _machine(spec: TrainingSpec, base_dir: Path, rehearsal: bool = False) -> Iterator[Issue]:
    """What the spec's `how` needs from the machine it runs on: CUDA for GPUs, the GPU extras for the kernels it
    names, memory per device for every training stage, credentials for S3. With a cluster, the compute nodes'
    (by a probe job), and nothing here imports torch: this machine only plans, submits and follows. A `rehearsal`
    leaves CUDA and the GPU extras to its ranks: CPU ranks (an emulated cluster, a laptop) compute on the CPU and
    replace CUDA-only kernels by their reference, saying so; a GPU rank without the extras stops at its first step
    with the command that installs them."""

    how = spec.how
    accelerator = how.hardware.accelerator
    smoke_hint = SMOKE_HINT
    if how.orchestration.cluster is not None:  # training runs on the cluster's nodes, not on this machine

        missing = [c for c in ("sbatch", "scontrol", "scancel") if shutil.which(c) is None]
        if missing:
            yield Issue(("how", "orchestration", "cluster"), f"the spec runs its steps as Slurm jobs and "
                        f"{', '.join(missing)} {'is' if len(missing) == 1 else 'are'} not on this machine's PATH",
                        f"run compass on a Slurm login node, {smoke_hint}")
        else:
            reachable = list(_slurm_partition(how.orchestration.cluster.partition, smoke_hint))
            for phase in PHASES:  # a phase's own partition, where the spec names one
                named = getattr(how.resources, phase).partition
                if not reachable and named:
                    reachable += _slurm_partition(named, smoke_hint, ("how", "resources", phase, "partition"))
            yield from reachable
            if not reachable and how.orchestration.cluster.shared_root:
                yield from _shared_paths(spec, base_dir, gpu_extras=not rehearsal)
    else:
        if not rehearsal:
            yield from _kernels_here(spec)
    if how.attention == "flex" and accelerator == "cpu":
        yield Issue(("how", "attention"), "FlexAttention has no backward pass on CPU: it cannot train here",
                    "use attention: sdpa (or auto) on CPU")
    yield from _trackers(spec)
    s3 = _s3_uris(spec)
    if s3 and not spec.how.storage.credentials_block and not s3_credentials_here():
        loc, uri = s3[0]
        yield Issue(loc, f"{uri} is on S3 and no S3 credentials are set on this machine",
                    "set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (and AWS_ENDPOINT_URL for S3-compatible "
                    "stores), an AWS profile, or how.storage.credentials_block")


def _memory(spec: TrainingSpec) -> Iterator[Issue]:
    """Every step that trains or evaluates fits its device: compass's training stages, TRL's steps and the passkey
    evaluation, each by the estimate `compass plan` prints. Refused here, not weeks into the run."""

    how = spec.how
    accelerator = how.hardware.accelerator
    device = costs.device_memory_bytes(how)
    for loc, length, estimate in costs.training_memory(spec):
        if estimate.total > device:
            yield Issue(loc, f"a training step at {length} tokens needs ~{estimate.total / costs.GIB:.0f} GiB per "
                        f"{accelerator} (activations {estimate.activations / costs.GIB:.0f} GiB), more than its "
                        f"{device / costs.GIB:.0f} GiB", "turn on parallelism.activation_checkpointing, raise "
                        "zero_stage or tensor_parallel, or lower the micro-batch")
    names = {post.name: i for i, post in enumerate(spec.what.post_training)}
    for step in costs.library_step_memory(spec):
        if step.total <= device:
            continue
        what = (f"{step.step} needs ~{step.total / costs.GIB:.0f} GiB per {accelerator} (weights and optimizer "
                f"{step.weights / costs.GIB:.0f}, activations {step.activations / costs.GIB:.0f}, logits "
                f"{step.logits / costs.GIB:.0f} GiB: {step.micro_batch} rows of {step.length} tokens per pass on each "
                f"of {step.ranks} devices), more than its {device / costs.GIB:.0f} GiB")
        name = step.step.removeprefix("post_train:").split(" answers by ")[0]
        if step.step.startswith("post_train:") and name in names:
            yield Issue(("what", "post_training", names[name], "micro_batch_size"), what,
                        "set micro_batch_size (rows per pass; the batch accumulates), lower max_length, give "
                        "how.resources.post_training more devices with a higher zero_stage, turn on "
                        "parallelism.activation_checkpointing, use loss: liger (no full-vocabulary logits) or peft")
        else:
            yield Issue(("what", "long_context", "stages"), what,
                        "evaluate the passkey on a GPU with more memory (how.hardware.accelerator) or shorten the "
                        "longest stage")


def _trackers(spec: TrainingSpec) -> Iterator[Issue]:
    """A tracker the spec lists must have somewhere to report before any step trains."""
    mon = spec.how.monitoring
    loc = ("how", "monitoring", "trackers")
    if "mlflow" in mon.trackers and not (mon.mlflow_tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")):
        yield Issue(loc, "mlflow is listed and no MLflow server is named",
                    "set how.monitoring.mlflow_tracking_uri (http://host:5000) or MLFLOW_TRACKING_URI")
    netrc = Path(os.environ.get("NETRC", Path.home() / ".netrc"))
    if "wandb" in mon.trackers and mon.wandb_mode == "online" and not os.environ.get("WANDB_API_KEY") \
            and not (netrc.exists() and "api.wandb.ai" in netrc.read_text(errors="replace")):
        yield Issue(("how", "monitoring", "wandb_mode"), "W&B online needs an API key and none is set here",
                    "set WANDB_API_KEY (or `wandb login`), or wandb_mode: offline and `wandb sync` later")


def _s3_uris(spec: TrainingSpec) -> list[tuple[tuple[str | int, ...], str]]:
    uris = [(("how", "storage", "root"), spec.how.storage.root)]
    uris += [(("what", "data", "sources", i, "uri"), s.uri) for i, s in enumerate(spec.what.data.sources)]
    uris += [(("what", "post_training", i, "dataset"), p.dataset) for i, p in enumerate(spec.what.post_training)]
    return [(loc, uri) for loc, uri in uris if uri.startswith("s3://")]


def _step_kind_names(spec: TrainingSpec) -> Iterator[Issue]:
    known = [k.name for k in registry.kinds()]
    for kind in spec.how.orchestration.step_timeouts:
        if kind not in known:
            yield Issue(("how", "orchestration", "step_timeouts", kind), f"unknown step kind '{kind}'",
                        f"one of: {', '.join(known)}")
