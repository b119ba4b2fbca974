"""No spec field without an effect (issue 47, item 4): every number, flag and list of names the example specs write
is changed, one at a time, to another legal value, and the change must reach the plan (a step's fingerprint, where
a step runs, or a section `compass plan` prints) or be refused at validation. A field that does neither would be
accepted and ignored. (Free text and choices among names are not walked here: names are checked by validation's
"did you mean", kinds and formats by their own tests.)"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import yaml

from compass.flows import plan_report
from compass.flows.validation import check
from compass.specs import load_spec
from compass.specs.loader import SpecError, load_spec_text
from compass.tasks.steps import registry
from compass.tasks.steps.placement import place
from tests.conftest import REPO

pytestmark = pytest.mark.slow
EXAMPLES = REPO / "specs" / "examples"
FieldPath = tuple[str | int, ...]  # keys and list indices, as in the YAML


def leaves(value: Any, path: FieldPath = ()) -> Iterator[tuple[FieldPath, Any]]:
    """Every written leaf: a scalar, or a list of scalars, by its path in the YAML."""
    if isinstance(value, dict):
        for key, inner in value.items():
            yield from leaves(inner, (*path, key))
    elif isinstance(value, list) and value and all(isinstance(v, dict | list) for v in value):
        for i, inner in enumerate(value):
            yield from leaves(inner, (*path, i))
    else:
        yield path, value


def changes(value: Any) -> list[Any]:
    """Other legal-looking values of the same type (validation decides which are legal)."""
    if isinstance(value, bool):
        return [not value]
    if isinstance(value, int):
        return [value + 1, value * 2, max(value - 1, 0)]
    if isinstance(value, float):
        return [value * 1.5 if value else 0.5, value * 0.5]
    if isinstance(value, list) and value and all(isinstance(v, str) for v in value):
        return [value[:-1] or [*value, *value[:1]]]
    return []


def plan_signature(text: str, name: str) -> tuple:
    """What a spec's text decides before anything runs: each step's fingerprint and placement, and what
    `compass plan` prints about it (machine checks off: the walk is about the spec alone)."""
    loaded = load_spec_text(text, name, base_dir=EXAMPLES)
    plan = check(loaded, machine=False).plan
    places = {s.id: place(registry.kind(s.kind), s.config, loaded.spec.how) for s in plan.steps}
    sections = [(s.title, s.columns, s.rows, s.notes) for s in plan_report.cost_sections(loaded.spec)]
    return dict(plan.fingerprints), repr(places), repr(sections)


@dataclass
class Walk:
    effect: list[str] = field(default_factory=list)
    refused: list[str] = field(default_factory=list)
    nothing: list[str] = field(default_factory=list)
    not_walked: list[str] = field(default_factory=list)


def walk(name: str) -> Walk:
    base = load_spec(EXAMPLES / name)
    data = json.loads(json.dumps(base.data))  # the spec as written, plain
    reference = plan_signature(base.text, name)
    out = Walk()
    for path, value in leaves(data):
        dotted = ".".join(map(str, path))
        options = changes(value)
        if not options:
            out.not_walked.append(dotted)
            continue
        outcome = "refused"
        for new in options:
            changed = copy.deepcopy(data)
            node = changed
            for key in path[:-1]:
                node = node[key]
            node[path[-1]] = new
            try:
                signature = plan_signature(yaml.safe_dump(changed, sort_keys=False), name)
            except SpecError:
                continue
            outcome = "effect" if signature != reference else "nothing"
            if outcome == "effect":
                break
        {"effect": out.effect, "refused": out.refused, "nothing": out.nothing}[outcome].append(dotted)
    return out


@pytest.mark.parametrize("name", ["tiny.yaml", "smollm3-3b.yaml"])
def test_every_field_the_example_writes_changes_the_plan_or_is_refused(name: str):
    found = walk(name)
    print(f"{name}: {len(found.effect)} fields change the plan, {len(found.refused)} changes refused, "
          f"{len(found.nothing)} without effect {found.nothing}, {len(found.not_walked)} not walked (text, choices)")
    assert len(found.effect) > 60  # the walk reached the spec's numbers and flags
    assert found.nothing == []


def test_the_walk_finds_a_field_that_changes_nothing(monkeypatch: pytest.MonkeyPatch):
    """The walk itself: with the orchestration section gone from the plan, the retry settings reach nothing
    `compass plan` shows, and the walk names them."""
    real = plan_report.cost_sections
    monkeypatch.setattr(plan_report, "cost_sections", lambda spec, tflops=None: [
        s for s in real(spec, tflops) if s.title != "Orchestration"])
    assert {"how.orchestration.retries", "how.orchestration.retry_delay_seconds"} <= set(walk("tiny.yaml").nothing)
