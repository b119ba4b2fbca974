"""The one registry of step kinds. Each module below defines its kinds (`STEP_KINDS`, StepKind records); the
compiler runs their builders after the kinds whose steps each reads (tasks/steps/build_order.py), so this order
only decides how independent steps are listed.
Installed distributions add kinds through the `compass.step_kinds` entry point group (a module with
`STEP_KINDS`), and code can call `register()`.

Kind modules import their heavy libraries inside functions: loading the registry (what `compass validate`
does) stays fast.
"""

from __future__ import annotations

from functools import cache
from importlib import import_module
from importlib.metadata import entry_points

from compass.tasks.steps.kind import StepKind

BUILTIN = (
    "compass.tasks.kinds.gate",
    "compass.tasks.kinds.base_model",
    "compass.tasks.kinds.ingest",
    "compass.tasks.kinds.curate",
    "compass.tasks.kinds.select_tokenizer",
    "compass.tasks.kinds.encode_tokens",
    "compass.tasks.kinds.ablate",
    "compass.tasks.kinds.pretrain",
    "compass.tasks.kinds.long_context",
    "compass.tasks.kinds.post_train",
    "compass.tasks.kinds.mid_training",
    "compass.tasks.kinds.evaluate",
    "compass.tasks.kinds.decontaminate",
    "compass.tasks.kinds.curves",
    "compass.tasks.kinds.success_report",
)
ENTRY_POINTS = "compass.step_kinds"

_registered: list[StepKind] = []


@cache
def _discovered() -> tuple[StepKind, ...]:
    modules = [import_module(name) for name in BUILTIN]
    modules += [ep.load() for ep in entry_points(group=ENTRY_POINTS)]
    return tuple(kind for module in modules for kind in module.STEP_KINDS)


def kinds() -> list[StepKind]:
    """Every kind, in build order: the built-in ones, installed plugins, then those registered at run time."""
    out = [*_discovered(), *_registered]
    names = [k.name for k in out]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ValueError(f"step kinds registered twice: {', '.join(duplicates)}")
    return out


def kind(name: str) -> StepKind:
    for k in kinds():
        if k.name == name:
            return k
    raise KeyError(f"no step kind '{name}' (known: {', '.join(k.name for k in kinds())})")


def register(step_kind: StepKind) -> None:
    """Add a kind after the others (its builder runs last)."""
    if any(k.name == step_kind.name for k in kinds()):
        raise ValueError(f"a step kind '{step_kind.name}' is already registered")
    _registered.append(step_kind)


def unregister(name: str) -> None:
    _registered[:] = [k for k in _registered if k.name != name]


def model_kinds() -> list[str]:
    """Kinds whose artifacts hold a model to evaluate (scored, and named by success criteria)."""
    return [k.name for k in kinds() if k.evaluated]


def deployment_kinds(deployment: str) -> list[str]:
    return [k.name for k in kinds() if k.deployment == deployment]
