"""Preflight: what a spec needs beyond its own rules, checked before anything runs or is written.

The loader (compass.specs) checks the spec alone. Here come the checks that need the rest of compass or the
machine: the compiled plan (every checkpoint a spec names exists, every step kind it times out is one), and
each step kind's own preflight (local paths, installed libraries' signatures, cached hub objects, datasets).
Problems come back like the loader's, as `file:line: field: what (hint)`, all at once.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from compass.flows.compiler import Plan, PlanError, compile_spec
from compass.specs.base import Issue
from compass.specs.loader import LoadedSpec, SpecError, load_spec, load_spec_text
from compass.specs.spec import TrainingSpec
from compass.tasks import registry


@dataclass(frozen=True)
class CheckedSpec:
    """A spec that passed every check, with its compiled plan."""

    loaded: LoadedSpec
    plan: Plan

    @property
    def spec(self) -> TrainingSpec:
        return self.loaded.spec


def check(loaded: LoadedSpec) -> CheckedSpec:
    """Compile the plan and run every kind's preflight; SpecError lists all problems found."""
    issues = list(_step_kind_names(loaded.spec))
    for kind in registry.kinds():
        if kind.preflight is not None:
            issues += kind.preflight(loaded.spec, loaded.base_dir)
    plan = None
    try:
        plan = compile_spec(loaded.spec)
    except PlanError as exc:
        issues += exc.issues
    if issues or plan is None:
        raise SpecError(loaded.problems(issues))
    return CheckedSpec(loaded, plan)


def load_checked(path: str | Path) -> CheckedSpec:
    return check(load_spec(path))


def load_checked_text(text: str, filename: str = "<spec>", base_dir: Path | None = None) -> CheckedSpec:
    return check(load_spec_text(text, filename, base_dir))


def _step_kind_names(spec: TrainingSpec) -> Iterator[Issue]:
    known = [k.name for k in registry.kinds()]
    for kind in spec.how.orchestration.step_timeouts:
        if kind not in known:
            yield Issue(("how", "orchestration", "step_timeouts", kind), f"unknown step kind '{kind}'",
                        f"one of: {', '.join(known)}")
