"""The pure compiler: a TrainingSpec becomes a Plan, a DAG of Steps (no Prefect here, so it unit-tests fast).

Each registered step kind adds its steps, after the kinds whose steps it reads (tasks/steps/build_order.py); each
Step carries only the slice of the spec it reads, so changing one field re-runs exactly the steps that read it and
their descendants.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from compass.infra.fingerprint import fingerprint
from compass.specs.base import Issue
from compass.specs.how import How
from compass.specs.spec import TrainingSpec
from compass.tasks.steps import registry
from compass.tasks.steps.build_order import build_order
from compass.tasks.steps.kind import PlanBuilder, Step


class UnknownTarget(ValueError):
    """`--until` named something the plan does not have."""


class PlanError(ValueError):
    """The spec names things no step produces (e.g. a checkpoint); `issues` locate each in the spec."""

    def __init__(self, issues: list[Issue]):
        self.issues = issues
        super().__init__("; ".join(i.message for i in issues))


@dataclass
class Plan:
    """Steps in dependency order with their fingerprints, and the `how` they were compiled under (the plan says
    when a committed artifact was made under another)."""

    spec_name: str
    steps: list[Step]
    fingerprints: dict[str, str]
    how: How = field(default_factory=How)

    def step(self, step_id: str) -> Step:
        return next(s for s in self.steps if s.id == step_id)

    def up_to(self, targets: list[str]) -> Plan:
        """The steps named in `targets` (a step id such as `pretrain:stage1`, or a kind such as `pretrain`) and
        every step they need: what `--until` runs. Raises UnknownTarget for a name that matches no step."""
        unknown = [t for t in targets if not any(t in (s.id, s.kind) for s in self.steps)]
        if unknown:
            kinds = sorted({s.kind for s in self.steps})
            raise UnknownTarget(f"--until {', '.join(unknown)}: no such step or step kind in this spec's plan; "
                                f"use a kind ({', '.join(kinds)}) or a step id such as {self.steps[-1].id}")
        wanted = {s.id for s in self.steps if s.id in targets or s.kind in targets}
        frontier = set(wanted)
        while frontier:
            needed = {i for s in self.steps if s.id in frontier for i in s.needs} - wanted
            wanted |= needed
            frontier = needed
        return self._subset(wanted)

    def restricted_to(self, kinds: set[str]) -> Plan:
        """The sub-plan of steps of the given kinds whose inputs are all inside it, with the steps they wait for
        (a fence that may stop them) and what those need."""
        ids: set[str] = set()
        for s in self.steps:
            if s.kind in kinds and set(s.inputs.values()) <= ids:
                ids.add(s.id)
        return self.up_to(sorted(ids)) if ids else self._subset(ids)

    def _subset(self, ids: set[str]) -> Plan:
        return Plan(self.spec_name, [s for s in self.steps if s.id in ids],
                    {i: fp for i, fp in self.fingerprints.items() if i in ids}, self.how)


def compile_spec(spec: TrainingSpec) -> Plan:
    """Build the lifecycle DAG: every registered kind adds its steps (ingest -> curate -> tokenizer -> ablations
    -> pretraining stages -> long-context stages -> post-training -> evaluation -> curves and success report).
    Raises PlanError when the spec names a checkpoint that no step produces."""
    kinds = registry.kinds()
    builder = PlanBuilder(spec, kinds)
    for kind in build_order(kinds):
        builder.run_builder(kind)
    if builder.issues:
        raise PlanError(builder.issues)
    return _order(spec.name, builder.steps, spec.how)


def _order(spec_name: str, steps: list[Step], how: How) -> Plan:
    by_id = {s.id: s for s in steps}
    for s in steps:
        missing = set(s.needs) - set(by_id)
        if missing:
            raise ValueError(f"step {s.id} depends on unknown steps {sorted(missing)}")
    ordered = _stable_topo(steps)
    fps: dict[str, str] = {}
    for s in ordered:
        inputs = {role: fps[dep] for role, dep in s.inputs.items()}
        kind = registry.kind(s.kind)
        fps[s.id] = fingerprint(s.kind, s.config.identity(), inputs, kind.version, kind.how_identity(s.config, how))
    return Plan(spec_name, ordered, fps, how)


def _stable_topo(steps: list[Step]) -> list[Step]:
    """Dependency order that keeps declaration order where the DAG allows, so plans read like the spec."""
    done: set[str] = set()
    out: list[Step] = []
    pending = list(steps)
    while pending:
        ready = next((s for s in pending if set(s.needs) <= done), None)
        if ready is None:
            raise ValueError(f"steps depend on each other in a cycle: {', '.join(s.id for s in pending)}")
        out.append(ready)
        done.add(ready.id)
        pending.remove(ready)
    return out
