"""The pure compiler: DAG shape, fingerprints, and which steps a one-field change touches."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from compass.flows.compiler import compile_spec
from compass.specs import load_spec, load_spec_text

EXAMPLES = Path(__file__).parent.parent / "specs" / "examples"


@pytest.fixture(scope="module")
def tiny_text() -> str:
    return (EXAMPLES / "tiny.yaml").read_text()


def plan_of(text: str):
    return compile_spec(load_spec_text(text, "tiny.yaml", base_dir=EXAMPLES).spec)


def changed(a, b) -> set[str]:
    return {sid for sid in a.fingerprints if a.fingerprints[sid] != b.fingerprints.get(sid)}


def descendants(plan, step_id: str) -> set[str]:
    out: set[str] = set()
    frontier = {step_id}
    while frontier:
        frontier = {s.id for s in plan.steps if set(s.inputs.values()) & frontier} - out
        out |= frontier
    return out


def test_compiler_imports_no_prefect():
    code = "import sys, compass.flows.compiler; assert not [m for m in sys.modules if m.startswith('prefect')]"
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("name", ["tiny.yaml", "smollm3-3b.yaml"])
def test_examples_compile_in_dependency_order(name: str):
    plan = compile_spec(load_spec(EXAMPLES / name).spec)
    seen: set[str] = set()
    for step in plan.steps:
        assert set(step.inputs.values()) <= seen, step.id
        seen.add(step.id)
    kinds = {s.kind for s in plan.steps}
    assert {"ingest", "curate", "tokenizer", "ablate", "pretrain", "long_context", "post_train", "evaluate",
            "compare", "report"} <= kinds
    assert len(set(plan.fingerprints.values())) == len(plan.steps)


def test_fingerprints_are_stable(tiny_text: str):
    assert plan_of(tiny_text).fingerprints == plan_of(tiny_text).fingerprints


def test_tokenizer_field_touches_tokenizer_and_descendants_only(tiny_text: str):
    base = plan_of(tiny_text)
    edited = plan_of(tiny_text.replace("train_chars: 6000000", "train_chars: 5000000"))
    assert changed(base, edited) == {"tokenizer:select"} | descendants(base, "tokenizer:select")
    assert not any(s.startswith(("ingest:", "curate:")) for s in changed(base, edited))


def test_one_source_curation_touches_that_source_only(tiny_text: str):
    base = plan_of(tiny_text)
    edited = plan_of(tiny_text.replace("language_id: {keep: [fr], min_score: 0.5}",
                                       "language_id: {keep: [fr], min_score: 0.6}"))
    diff = changed(base, edited)
    assert diff == {"curate:docs_fr"} | descendants(base, "curate:docs_fr")
    assert "ingest:docs_fr" not in diff and "curate:docs_de" not in diff


def test_orchestration_and_storage_do_not_change_identity(tiny_text: str):
    base = plan_of(tiny_text)
    edited = plan_of(tiny_text.replace("retries: 1, retry_delay_seconds: 5, task_runner: local, workers: 2",
                                       "retries: 5, retry_delay_seconds: 60, task_runner: ray, workers: 8")
                     .replace("storage: {root: store}", "storage: {root: 's3://bucket/runs'}"))
    assert changed(base, edited) == set()


def test_extending_a_stable_wsd_stage_keeps_earlier_stages(tiny_text: str):
    base = plan_of(tiny_text)
    edited = plan_of(tiny_text.replace("tokens: 200000", "tokens: 300000"))  # stage2 (the decay stage)
    diff = changed(base, edited)
    assert "pretrain:stage1" not in diff and "pretrain:stage2" in diff


def test_ablation_variants_are_separate_steps_per_seed(tiny_text: str):
    plan = plan_of(tiny_text)
    runs = [s for s in plan.steps if s.kind == "ablate"]
    assert {s.name for s in runs} == {"baseline-s0", "baseline-s1", "untied-s0", "untied-s1"}
    untied = next(s for s in runs if s.name == "untied-s0")
    assert untied.config.change == {"architecture.tied_embeddings": False}


def test_until_runs_the_named_steps_and_everything_they_need(tiny_text: str):
    plan = plan_of(tiny_text)
    stage1 = plan.up_to(["pretrain:stage1"])
    ids = [s.id for s in stage1.steps]
    assert ids[-1] == "pretrain:stage1" and "pretrain:stage2" not in ids
    assert {"tokenizer:select", "ingest:docs_en", "tokenize:code_py"} <= set(ids)
    assert not any(s.kind in ("ablate", "evaluate", "post_train") for s in stage1.steps)
    for step in stage1.steps:  # closed under inputs, fingerprints unchanged
        assert set(step.inputs.values()) <= set(ids) and stage1.fingerprints[step.id] == plan.fingerprints[step.id]
    ablations = plan.up_to(["compare"])
    assert {s.kind for s in ablations.steps} == {"ingest", "curate", "tokenizer", "tokenize", "ablate", "compare",
                                                 "fence_index"}  # the demo's `remove`: its tokens pass the fence


def test_until_with_an_unknown_name_exits_2_before_running(tmp_path: Path):
    done = subprocess.run([sys.executable, "-m", "compass.flows.cli.app", "run", str(EXAMPLES / "tiny.yaml"),
                           "--until", "pretrian", "--store", str(tmp_path / "store")],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert "--until pretrian: no such step or step kind" in done.stderr and "pretrain" in done.stderr
    assert not (tmp_path / "store").exists()


def test_schema_command_prints_a_schema_the_examples_satisfy():
    import json

    import jsonschema
    from ruamel.yaml import YAML

    done = subprocess.run([sys.executable, "-m", "compass.flows.cli.app", "schema"], capture_output=True, text=True,
                          check=True)
    schema = json.loads(done.stdout)
    assert set(schema["properties"]) == {"name", "description", "why", "what", "how"}
    for name in ("tiny.yaml", "smollm3-3b.yaml"):
        jsonschema.validate(YAML(typ="safe").load((EXAMPLES / name).read_text()), schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"name": "x", "why": {}, "what": {}, "hw": 1}, schema)


def test_step_timeouts_accept_every_registered_kind(tmp_path: Path):
    from compass.flows.validation import load_checked
    from compass.tasks.steps import registry
    from tests.conftest import write_minimal_spec

    timeouts = ", ".join(f"{k.name}: 3600" for k in registry.kinds())
    spec = write_minimal_spec(tmp_path, **{"how:\n": f"how:\n  orchestration: {{step_timeouts: {{{timeouts}}}}}\n"})
    checked = load_checked(spec)
    assert set(checked.spec.how.orchestration.step_timeouts) >= {"ingest", "tokenize", "curate", "pretrain"}
