"""The order the kinds' builders run in, from what each reads (StepKind.after, after_models), not from the
registry's order: a kind registered anywhere builds after the kinds it reads and before those that read it.

The registry's order only breaks ties between kinds that do not read each other, so plans list independent
steps the way the registry lists their kinds.
"""

from __future__ import annotations

from collections.abc import Sequence

from compass.tasks.steps.kind import StepKind


class BuildCycle(ValueError):
    """Kinds that read each other's steps: no order can build them."""


def _explicit(kinds: Sequence[StepKind]) -> dict[str, set[str]]:
    """kind -> the kinds it builds after, by `after`, through kinds without a builder (asked for on demand: a
    kind that requires tokens builds after what the tokenize provider reads)."""
    by_name = {k.name: k for k in kinds}
    out: dict[str, set[str]] = {}
    for kind in kinds:
        seen: set[str] = set()
        frontier = list(kind.after)
        while frontier:
            name = frontier.pop()
            if name in seen or name == kind.name:
                continue
            seen.add(name)
            other = by_name.get(name)
            if other is not None and other.build is None:
                frontier.extend(other.after)
        out[kind.name] = {n for n in seen if n in by_name and by_name[n].build is not None}
    return out


def _reaches(edges: dict[str, set[str]], start: str, goal: str) -> bool:
    """Whether `start` builds after `goal`, following `edges` (kind -> kinds before it)."""
    seen, frontier = set(), [start]
    while frontier:
        name = frontier.pop()
        if name == goal:
            return True
        if name not in seen:
            seen.add(name)
            frontier.extend(edges.get(name, ()))
    return False


def build_order(kinds: Sequence[StepKind]) -> list[StepKind]:
    """Every kind, each after the kinds it reads. A kind that reads the models built so far (after_models) builds
    after every model kind but those that themselves build after it (a kind that trains on post-training's model
    comes after post-training, whatever the registry says)."""
    before = _explicit(kinds)
    explicit = {name: set(names) for name, names in before.items()}
    model_kinds = [k for k in kinds if (k.evaluated or k.advances_model) and k.build is not None]
    for kind in kinds:
        if kind.after_models:
            before[kind.name] |= {m.name for m in model_kinds
                                  if m.name != kind.name and not _reaches(explicit, m.name, kind.name)}
    order: list[StepKind] = []
    placed: set[str] = set()
    pending = list(kinds)
    while pending:
        ready = next((k for k in pending if before[k.name] <= placed), None)
        if ready is None:
            cycle = ", ".join(f"{k.name} (after {', '.join(sorted(before[k.name] - placed))})" for k in pending)
            raise BuildCycle(f"step kinds read each other's steps, no order builds them: {cycle}")
        order.append(ready)
        placed.add(ready.name)
        pending.remove(ready)
    return order
