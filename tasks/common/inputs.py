"""The typed inputs that several kinds share (tasks/steps/wiring.py): the gates a first training step waits for,
and a training step's tokenizer, token sets and the model it continues."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import ClassVar

from compass.tasks.steps.kind import PlanBuilder
from compass.tasks.steps.wiring import Inputs, R, StepRef

TOKENIZE = "tokenize"  # the kind that adds a source's token set on demand (tasks/kinds/encode_tokens.py)
GATE = "gate"
EVALUATE = "evaluate"


@dataclass(frozen=True)
class Gated(Inputs[R]):
    """A step that waits for every gate's verdict (none without a production `why`)."""

    gate: Mapping[str, R] = field(default_factory=dict)


@dataclass(frozen=True)
class TrainingInputs(Inputs[R]):
    """A training step: the tokenizer, a token set per source of its mixture, and the model it continues (none for
    a first stage, which waits for the gates instead)."""

    tokenizer: R
    tokens: Mapping[str, R]
    previous: R | None = None
    gate: Mapping[str, R] = field(default_factory=dict)


@dataclass(frozen=True)
class EvaluateInputs(Inputs[R]):
    """The model to score, the tokenizer, the held-out token sets perplexity reads, and the passkey haystack's."""

    model: R
    tokenizer: R
    tokens: Mapping[str, R]
    haystack: R | None = None


@dataclass(frozen=True)
class Evaluations(Inputs[R]):
    """The evaluation of each model step, by the model step's id (roles `eval:<kind>:<name>`)."""

    prefixes: ClassVar[Mapping[str, str]] = {"evaluations": "eval:"}
    evaluations: Mapping[str, R]


def evaluations_by_model(plan: PlanBuilder) -> dict[str, StepRef]:
    """model step id -> the evaluate step that scores it."""
    return {s.wired.model.id: s.ref for s in plan.of_kind(EVALUATE) if isinstance(s.wired, EvaluateInputs)}


def gates(plan: PlanBuilder) -> dict[str, StepRef]:
    return {s.name: s.ref for s in plan.of_kind(GATE)}


def tokens(plan: PlanBuilder, sources: Iterable[str]) -> dict[str, StepRef]:
    """Each source's token set, asked for (and so added) in name order."""
    return {name: plan.require(TOKENIZE, name) for name in sorted(sources)}


def training_inputs(plan: PlanBuilder, sources: Iterable[str], previous: StepRef | None) -> TrainingInputs:
    """A stage that continues `previous`, or (None) a first stage that waits for the gates."""
    return TrainingInputs(tokenizer=plan.tokenizer(), tokens=tokens(plan, sources), previous=previous,
                          gate={} if previous else gates(plan))
