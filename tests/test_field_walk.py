"""No spec field without an effect (issue 47, item 4): every number, flag, choice and list of names the example
specs write is changed, one at a time, to another legal value, and the change must reach the plan (a step's
fingerprint, where a step runs, or a section `compass plan` prints) or be refused at validation. A field that does
neither would be accepted and ignored. A choice is a field whose schema lists its values (a kind, a format, a
precision): each other value is tried. (Free text is not walked: names are checked by validation's "did you mean".)"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import yaml

from compass.flows.reports import plan_tables as plan_report
from compass.flows.validation import check
from compass.specs import load_spec
from compass.specs.loader import SpecError, load_spec_text
from compass.specs.spec import TrainingSpec
from compass.tasks.steps import registry
from compass.tasks.steps.placement import place
from tests.conftest import REPO
from tests.hub_cache import seed_smollm3_base

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


SCHEMA = TrainingSpec.model_json_schema()


def _resolved(node: dict) -> dict:
    while "$ref" in node:
        node = SCHEMA["$defs"][node["$ref"].rsplit("/", 1)[-1]]
    return node


def _branches(node: dict) -> list[dict]:
    """A schema node as the plain alternatives it allows (a union's members, one by one)."""
    node = _resolved(node)
    members = node.get("anyOf") or node.get("oneOf")
    return [b for m in members for b in _branches(m)] if members else [node]


def _children(node: dict, key: str | int) -> list[dict]:
    found = []
    for branch in _branches(node):
        if isinstance(key, int) and "items" in branch:
            found.append(branch["items"])
        elif isinstance(key, str) and key in branch.get("properties", {}):
            found.append(branch["properties"][key])
        elif isinstance(key, str) and isinstance(branch.get("additionalProperties"), dict):
            found.append(branch["additionalProperties"])
    return found


def choices(path: FieldPath) -> list[str]:
    """The values the schema allows for the field at `path` when it lists them (Literal fields), else []."""
    nodes = [SCHEMA]
    for key in path:
        nodes = [child for node in nodes for child in _children(node, key)]
    listed: dict[str, None] = {}
    for node in nodes:
        for branch in _branches(node):
            for value in branch.get("enum", [branch["const"]] if "const" in branch else []):
                if isinstance(value, str):
                    listed[value] = None
    return list(listed)


def changes(value: Any, path: FieldPath = ()) -> list[Any]:
    """Other legal-looking values of the same type (validation decides which are legal)."""
    if isinstance(value, str):
        return [c for c in choices(path) if c != value]
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
        options = changes(value, path)
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


@pytest.mark.parametrize(("name", "reached"), [("tiny.yaml", 100), ("smollm3-3b.yaml", 80),
                                               ("smollm3-finetune.yaml", 20)])
def test_every_field_the_example_writes_changes_the_plan_or_is_refused(name: str, reached: int, tmp_path,
                                                                       monkeypatch):
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path / "cache"))
    seed_smollm3_base(tmp_path / "cache", tmp_path / "files")  # the base the fine-tune example reads
    found = walk(name)
    print(f"{name}: {len(found.effect)} fields change the plan, {len(found.refused)} changes refused, "
          f"{len(found.nothing)} without effect {found.nothing}, {len(found.not_walked)} not walked (free text)")
    assert len(found.effect) > reached  # the walk reached the spec's numbers, flags and choices
    assert found.nothing == []


def test_the_walk_finds_a_field_that_changes_nothing(monkeypatch: pytest.MonkeyPatch):
    """The walk itself: with the orchestration section gone from the plan, the retry settings reach nothing
    `compass plan` shows, and the walk names them."""
    real = plan_report.cost_sections
    monkeypatch.setattr(plan_report, "cost_sections", lambda spec, tflops=None: [
        s for s in real(spec, tflops) if s.title != "Orchestration"])
    assert {"how.orchestration.retries", "how.orchestration.retry_delay_seconds"} <= set(walk("tiny.yaml").nothing)


def test_choices_are_read_from_the_schema():
    """The walk tries every other value of a choice: through references, lists, unions and mappings."""
    assert choices(("how", "precision")) == ["fp32", "bf16", "fp16"]
    assert "wsd" in choices(("what", "pretraining", "schedule", "kind"))
    assert {"cf", "mcf"} <= set(choices(("what", "evaluation", "benchmarks", 0, "formulation")))
    assert {"sft", "dpo", "grpo"} <= set(choices(("what", "post_training", 0, "method")))
    assert choices(("name",)) == []  # free text
