"""Validation: what a spec needs beyond its own rules, checked before anything runs or is written.

The loader (compass.specs) checks the spec alone. Here come the checks that need the rest of compass or the
machine: the compiled plan (every checkpoint a spec names exists, every step kind it times out is one), and
each step kind's own machine checks (local paths, installed libraries' signatures, cached hub objects, datasets).
Problems come back like the loader's, as `file:line: field: what (hint)`, all at once.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, replace
from pathlib import Path

from compass.flows.compiler import Plan, PlanError, compile_spec
from compass.flows.server.confinement import local_paths
from compass.specs import costs
from compass.specs.base import Issue, Loc
from compass.specs.checks import check_spec, phases_of
from compass.specs.file_stamp import s3_credentials_here
from compass.specs.loader import LoadedSpec, SpecError, load_spec, load_spec_text, merged_problems
from compass.specs.smoke import Shrink, Size, shrunk_spec
from compass.specs.spec import TrainingSpec
from compass.tasks.steps import registry
from compass.tasks.steps.backends import MachineCheck, backends_of, one_of_each


@dataclass(frozen=True)
class CheckedSpec:
    """A spec that passed every check, with its compiled plan."""

    loaded: LoadedSpec
    plan: Plan

    @property
    def spec(self) -> TrainingSpec:
        return self.loaded.spec


def check(loaded: LoadedSpec, machine: bool = True, writes: bool = True) -> CheckedSpec:
    """Compile the plan and run every kind's checks; SpecError lists all problems found. `machine=False` leaves out
    what depends on the machine it runs on (GPUs, GPU extras, memory, credentials, local paths, the Hugging Face
    cache): for checking a spec alone, or planning a cluster's run from a laptop. `writes=False` leaves out the
    checks that write (a cluster's probe job): for a spec found wrong already."""
    issues = list(_step_kind_names(loaded.spec))
    if machine or loaded.spec.how.hardware.accelerator != "cpu":  # a GPU's memory is its kind's, wherever it runs
        issues += _memory(loaded.spec)
    if machine:
        issues += _machine(loaded.spec, loaded.base_dir, rehearsal=loaded.size == "rehearsal", writes=writes)
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
    return _checked(lambda: load_spec(path), machine, size)


def load_checked_text(text: str, filename: str = "<spec>", base_dir: Path | None = None, machine: bool = True,
                      size: Size = "full") -> CheckedSpec:
    return _checked(lambda: load_spec_text(text, filename, base_dir), machine, size)


def _checked(load: Callable[[], LoadedSpec], machine: bool, size: Size) -> CheckedSpec:
    """The loaded spec checked; one with problems of its own is still checked here as far as what parsed allows
    (the error's `partial`), so that every problem comes out in one run."""
    try:
        loaded = load()
    except SpecError as exc:
        if exc.partial is None:
            raise
        try:
            check(shrunk(exc.partial, size), machine, writes=False)  # no probe job: bad input writes nothing
        except SpecError as more:
            raise SpecError(merged_problems([*exc.problems, *more.problems])) from None
        except Exception:  # a check that cannot judge a spec with problems: the problems found so far
            raise exc from None
        raise
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


def _node_paths(spec: TrainingSpec, base_dir: Path) -> dict[str, tuple[Loc, str]]:
    """The paths outside the store the steps read wherever they run, by path (the spec field, what it is): the
    store's nearest existing folder (the first run may create the store itself), the local data, the Hugging Face
    cache's snapshots (tokenizers, datasets, models); a cluster's probe job proves a compute node sees each."""
    wanted: dict[str, tuple[Loc, str]] = {}
    root = spec.how.storage.root_at(base_dir)
    if "://" not in root:
        folder = Path(root)
        while not folder.exists() and folder != folder.parent:
            folder = folder.parent
        wanted[str(folder)] = (("how", "storage", "root"), f"the store {root} ({folder})")
    for loc, uri, path in local_paths(spec, base_dir):
        if path.exists():
            wanted[str(path)] = (loc, f"{uri} ({path})")
    for kind in registry.kinds():
        for needed in kind.node_files(spec) if kind.node_files else ():
            wanted[str(needed.path)] = (needed.loc, f"{needed.what} ({needed.path})")
    return wanted


def _machine(spec: TrainingSpec, base_dir: Path, rehearsal: bool = False, writes: bool = True) -> Iterator[Issue]:
    """What the spec's `how` needs from the machine it runs on: CUDA for GPUs, the GPU extras for the kernels it
    names, memory per device for every training stage, credentials for S3. With a cluster, the compute nodes'
    (by a probe job), and nothing here imports torch: this machine only plans, submits and follows. A `rehearsal`
    leaves CUDA and the GPU extras to its ranks: CPU ranks (an emulated cluster, a laptop) compute on the CPU and
    replace CUDA-only kernels by their reference, saying so; a GPU rank without the extras stops at its first step
    with the command that installs them."""

    how = spec.how
    accelerator = how.hardware.accelerator
    check = MachineCheck(spec, base_dir, rehearsal, node_paths=lambda: _node_paths(spec, base_dir), writes=writes)
    for backend in one_of_each(backends_of(how, phases_of(spec))):  # each kind of machine the steps run on, once
        yield from backend.machine_checks(check)
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
