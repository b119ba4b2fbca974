"""Steps and step kinds: what the compiler builds and the runner executes.

A step kind is one record (StepKind): its config model, the function that executes it, the function that adds
its steps to a plan, its code version, the resources its steps need, and how it is shown and deployed.
Adding a kind means writing one module that defines such a record and listing it once in the registry.
"""

from __future__ import annotations

import importlib
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from compass.specs.base import Issue, Loc
from compass.specs.how import How
from compass.specs.how_identity import identity_of, value_at
from compass.specs.spec import TrainingSpec
from compass.specs.starting_model import NAMED_MODEL_PREFIX
from compass.tasks.steps.context import StepContext, StepResult
from compass.tasks.steps.placement import Resources, place
from compass.tasks.steps.step_config import StepConfig
from compass.tasks.steps.wiring import Inputs, NoInputs, StepRef

GPU_TAG = "gpu"  # steps that hold devices: Prefect's concurrency limit, max_parallel_gpu_steps on one machine


@dataclass(frozen=True)
class Step:
    """One unit of work: (kind, name, config, inputs). `inputs` maps a role to the id of another step (what the
    fingerprint, the manifest and the runner read); `wired` is the same as the kind's typed Inputs."""

    kind: str
    name: str
    config: StepConfig
    inputs: Mapping[str, str] = field(default_factory=dict)
    tags: tuple[str, ...] = ()
    wired: Inputs = field(default_factory=NoInputs)
    # steps it starts after without reading them: their verdict may stop the run (a fence), but not what it makes,
    # so they stay out of its identity
    waits_for: tuple[str, ...] = ()

    @property
    def id(self) -> str:
        return f"{self.kind}:{self.name}"

    @property
    def needs(self) -> tuple[str, ...]:
        """Every step it starts after: those it reads, then those it waits for."""
        return (*self.inputs.values(), *self.waits_for)

    @property
    def ref(self) -> StepRef:
        return StepRef(self.kind, self.name)


SpecCheck = Callable[[TrainingSpec, Path], Iterable[Issue]]  # the spec and the folder its relative paths start at


@dataclass(frozen=True)
class NodeFile:
    """A file or folder outside the store that a kind's steps read wherever they run (a snapshot in the Hugging Face
    cache): under a cluster, the probe job proves a compute node sees it at the same path."""

    loc: Loc  # the spec field that names it
    what: str  # as the error names it
    path: Path


NodeFiles = Callable[[TrainingSpec], Iterable[NodeFile]]


# Held while a thread imports a heavy library whose names resolve lazily (transformers): StepKind.import_names, and
# any step that imports one on a rare path (tasks/data/tokenizer_files.eos_id).
IMPORTING = threading.RLock()
TRANSFORMERS = tuple(f"transformers:{name}" for name in (
    "PreTrainedTokenizerFast", "AutoTokenizer", "AutoModelForCausalLM", "AutoConfig", "PreTrainedModel",
    "PretrainedConfig", "AttentionInterface", "SmolLM3Config", "Qwen3Config", "Qwen3MoeConfig"))


# What each family of kinds reads from `how` (StepKind.reads_how): compass's trainer (pretraining, long context,
# mid-training, ablations), TRL's trainers, and evaluation (lighteval, perplexity, passkey).
TRAINER_HOW = ("precision", "reduce_precision", "attention", "loss", "compile", "parallelism.engine_name",
               "parallelism.micro_batch_size", "hardware.accelerator", "parallelism.zero_stage",
               "parallelism.tensor_parallel", "parallelism.shard_group")
CHECKPOINT_HOW = ("checkpoints.every_steps", "checkpoints.keep_last", "checkpoints.hf_export_every")
# a training step whose artifact is evaluated (pretraining, long context, mid-training) keeps every export for
# evaluation when every_checkpoint asks
MODEL_TRAINER_HOW = (*TRAINER_HOW, *CHECKPOINT_HOW, "evaluation.every_checkpoint")
TRL_HOW = ("precision", "reduce_precision", "attention", "loss", "compile", "generation", "hardware.accelerator",
           "parallelism.zero_stage",  # TRL's optimizer is the HF Trainer's under either engine
           "checkpoints.every_minutes")  # placement: when it saves to resume, recorded, never in the fingerprint
EVALUATION_HOW = ("precision", "attention", "compile", "generation", "hardware.accelerator")


@dataclass(frozen=True)
class StepKind:
    """Everything compass knows about one kind of step, in one place."""

    name: str
    config: type[StepConfig]
    run: Callable[[StepContext], StepResult]
    build: Callable[[PlanBuilder], None] | None  # adds this kind's steps; None: other kinds ask for them (provide)
    version: str  # bump when the code changes what the kind produces: its steps then run again
    inputs: type[Inputs] = NoInputs  # what its steps read, typed (tasks/steps/wiring.py)
    # adds its step `name` when another kind's builder asks for it (PlanBuilder.require): a source's tokens
    provide: Callable[[PlanBuilder, str], None] | None = None
    # the kinds whose steps its builder (or provider) reads: their builders run first, whatever the registry's order
    after: tuple[str, ...] = ()
    after_models: bool = False  # its builder reads the models built so far: every model kind builds first
    # what one of its steps needs (nodes, devices, CPUs, memory, time): usually a phase's shape; None for steps that
    # only read other steps' manifests. tasks/steps/placement.py turns it into where the step runs.
    resources: Resources | None = None
    stops_run: Callable[[dict[str, Any]], str | None] | None = None  # from the step's metrics: why to stop the run
    trains: bool = False  # runs compass's trainer: followed live (progress, loss plot, checkpoint events)
    evaluated: bool = False  # its artifact holds a model to evaluate: scored, plotted, named by criteria
    advances_model: bool = False  # its model is the run's newest: the next stage continues it; `final` is the last
    provides_tokenizer: bool = False  # its artifact holds the run's tokenizer in `chosen/` (PlanBuilder.tokenizer)
    deployment: str | None = None  # "ablations": part of the ablation-only deployment
    # checks against what this compass and its libraries accept (filter parameters, benchmark names): everywhere
    check_spec: SpecCheck | None = None
    # checks of this machine before any work (local paths, cached hub files and datasets); `--no-machine-checks`
    # (planning a cluster's run from a laptop) leaves them out
    check_machine: SpecCheck | None = None
    node_files: NodeFiles | None = None  # what its steps read outside the store: probed on a compute node
    imports: tuple[str, ...] = ()  # "module:name" resolved, one thread at a time, before one of its steps computes
    # its work is datatrove stages: under a cluster they run as Slurm job arrays, the step's own job only drives them
    fans_out: bool = False
    headline: tuple[str, ...] = ()  # the metrics its commit line shows (the run's terminal, the Prefect logs)
    # dotted `how` paths its steps read (specs/how.py classifies each): the "results" ones enter their fingerprint,
    # all are recorded in the manifest, so the plan can say under what a reused artifact was made
    reads_how: tuple[str, ...] = ()

    def how_read(self, config: StepConfig, how: How) -> dict[str, Any]:
        """The values of the `how` fields one of its steps reads, by dotted path."""
        overridden = config.sets_how()
        return {path: value_at(how, path) for path in self.reads_how if path not in overridden}

    def how_identity(self, config: StepConfig, how: How) -> dict[str, Any]:
        """The part of `how_read` that changes what the step produces: part of its fingerprint."""
        return {p: v for p, v in self.how_read(config, how).items() if identity_of(p) == "results"}

    def import_names(self) -> None:
        """Resolve `imports` now, one thread at a time (IMPORTING). transformers 5 resolves its top-level names
        lazily and not thread-safely: two steps asking for one at once in their threads can get "cannot import
        name" (seen on the tokenize steps)."""
        with IMPORTING:
            for entry in self.imports:
                module, _, name = entry.partition(":")
                loaded = importlib.import_module(module)
                if name:
                    getattr(loaded, name)

    def step_tags(self, config: StepConfig, how: How) -> tuple[str, ...]:
        """`gpu` when the step holds devices (Prefect's concurrency limit counts those), else none: each tag costs
        a concurrency-slot request to the server per task (flows/lifecycle.py)."""

        return (GPU_TAG,) if place(self, config, how).holds_devices else ()


class BuildOrderError(ValueError):
    """A builder read the steps of a kind whose builder had not run: its `after` misses that kind."""


class PlanBuilder:
    """The steps added so far, in the order the kinds' builders add them (ordered by what each reads:
    tasks/steps/build_order.py), plus the problems found on the way (a checkpoint name that no step produces): the
    compiler reports them all. A builder that reads a kind whose builder has not run yet is an error naming the fix."""

    def __init__(self, spec: TrainingSpec, kinds: Iterable[StepKind] = ()):
        self.spec = spec
        self.steps: list[Step] = []
        self.kinds: dict[str, StepKind] = {k.name: k for k in kinds}
        self.issues: list[Issue] = []
        self.built: set[str] = set()  # kinds whose builders have run
        self.building: str | None = None

    def run_builder(self, kind: StepKind) -> None:
        self.kinds.setdefault(kind.name, kind)
        if kind.build is not None:
            self.building = kind.name
            try:
                kind.build(self)
            finally:
                self.building = None
        self.built.add(kind.name)

    def add(self, kind: StepKind, name: str, config: StepConfig, inputs: Inputs | None = None) -> StepRef:
        if not isinstance(config, kind.config):
            raise TypeError(f"{kind.name}:{name}: config is a {type(config).__name__}, not {kind.config.__name__}")
        wired = NoInputs() if inputs is None else inputs
        if not isinstance(wired, kind.inputs):
            raise TypeError(f"{kind.name}:{name}: inputs are a {type(wired).__name__}, not {kind.inputs.__name__}")
        step = Step(kind.name, name, config, wired.roles(), kind.step_tags(config, self.spec.how), wired)
        if self.has(step.id):
            raise ValueError(f"step {step.id} is added twice")
        self.steps.append(step)
        self.kinds.setdefault(kind.name, kind)
        return step.ref

    def has(self, step_id: str) -> bool:
        return any(s.id == step_id for s in self.steps)

    def hold(self, step_ids: Iterable[str], until: StepRef) -> None:
        """The steps `step_ids` start only once `until` is done (Step.waits_for), which stays out of their identity."""
        held = set(step_ids)
        self.steps = [replace(s, waits_for=(*s.waits_for, until.id)) if s.id in held else s for s in self.steps]

    def _read(self, kind: str) -> None:
        """Reading `kind`'s steps is only right once its builder has run (or it has none: steps on demand)."""
        known = self.kinds.get(kind)
        if known is None or known.build is None or kind in self.built or kind == self.building:
            return
        raise BuildOrderError(f"step kind '{self.building}' read the steps of '{kind}' before its builder ran: add "
                              f"'{kind}' to the `after` of '{self.building}'")

    def of_kind(self, kind: str) -> list[Step]:
        self._read(kind)
        return [s for s in self.steps if s.kind == kind]

    def ref(self, kind: str, name: str) -> StepRef:
        """A step another kind's builder added (curate's `ingest:<source>`); a missing one is a plan error."""
        self._read(kind)
        ref = StepRef(kind, name)
        if not self.has(ref.id):
            raise ValueError(f"no step {ref.id} in the plan (asked by '{self.building}')")
        return ref

    def require(self, kind: str, name: str) -> StepRef:
        """The step `kind:name`, added by its kind's provider the first time it is asked for (a source's tokens)."""
        ref = StepRef(kind, name)
        if not self.has(ref.id):
            provider = self.kinds.get(kind)
            if provider is None or provider.provide is None:
                raise ValueError(f"step kind '{kind}' adds no steps on demand (asked for {ref.id})")
            provider.provide(self, name)
            if not self.has(ref.id):
                raise ValueError(f"step kind '{kind}' was asked for {ref.id} and did not add it")
        return ref

    def tokenizer(self) -> StepRef:
        """The step whose artifact holds the run's tokenizer: the selection, or the starting checkpoint."""
        holders = [k for k in self.kinds.values() if k.provides_tokenizer]
        for k in holders:
            self._read(k.name)
        found = [s.ref for s in self.steps if self.kinds[s.kind].provides_tokenizer]
        if not found:
            raise ValueError("no step holds a tokenizer: the spec names neither what.tokenizer nor what.model")
        return found[0]

    def _models(self, wanted: Callable[[StepKind], bool]) -> list[StepRef]:
        for k in self.kinds.values():
            if wanted(k):
                self._read(k.name)
        return [s.ref for s in self.steps if wanted(self.kinds[s.kind])]

    def evaluated_models(self) -> list[StepRef]:
        """The steps so far whose model is evaluated, in training order."""
        return self._models(lambda k: k.evaluated)

    def newest_model(self) -> StepRef | None:
        """The model the next stage continues: the last step so far whose kind advances the model."""
        models = self._models(lambda k: k.advances_model)
        return models[-1] if models else None

    def checkpoint(self, ref: str, loc: Loc) -> StepRef | None:
        """The model step a spec names ('final' is the newest one so far, 'model:<name>' one of what.models); an
        unknown name is recorded as an issue at `loc` and gives None."""
        models = [m.id for m in self.evaluated_models()]
        newest = self.newest_model()
        if ref == "final" and newest is not None:
            return newest
        if ref in models:
            return StepRef.parse(ref)
        if ref.startswith(NAMED_MODEL_PREFIX):
            if self.has(ref):
                return StepRef.parse(ref)
            named = ", ".join(self.spec.what.models) or "none"
            self.issues.append(Issue(loc, f"no model '{ref.removeprefix(NAMED_MODEL_PREFIX)}' in what.models "
                                     f"(named there: {named})", "add it under what.models with its init_from"))
            return None
        valid = ", ".join(["final", *models]) if models else "none: no step before this one trains a model"
        self.issues.append(Issue(loc, f"unknown checkpoint '{ref}'", f"one of: {valid}, or model:<name> of "
                                 "what.models"))
        return None

