"""Typed wiring (tasks/steps/wiring.py) and the builders' order (tasks/steps/build_order.py): steps name the steps
they read with StepRefs in their kind's Inputs; the order of the registry does not change a plan; a kind added
anywhere builds after what it reads; a builder that reads a kind it did not declare is an error naming the fix."""

from __future__ import annotations

import ast
import random
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from pathlib import Path

import pytest

from compass.flows.compiler import Plan, compile_spec
from compass.specs import load_spec
from compass.tasks.steps import registry
from compass.tasks.steps.build_order import BuildCycle, build_order
from compass.tasks.steps.context import StepContext, StepResult
from compass.tasks.steps.kind import BuildOrderError, PlanBuilder, StepKind
from compass.tasks.steps.step_config import EmptyConfig
from compass.tasks.steps.wiring import Inputs, NoInputs, StepRef
from tests.conftest import REPO, write_minimal_spec

TINY = REPO / "specs" / "examples" / "tiny.yaml"


@dataclass(frozen=True)
class SoupInputs(Inputs):
    models: Mapping[str, StepRef]


def _soup_build(plan: PlanBuilder) -> None:
    """An average of every pretraining stage's weights: a model to evaluate, never the one the next stage continues."""
    stages = {s.name: s.ref for s in plan.of_kind("pretrain")}
    if len(stages) > 1:
        plan.add(SOUP, "stages", EmptyConfig(), SoupInputs(stages))


def _never_run(ctx: StepContext) -> StepResult:
    raise AssertionError("planning only")


SOUP = StepKind("soup", EmptyConfig, _never_run, _soup_build, version="1", inputs=SoupInputs, after=("pretrain",),
                evaluated=True)


def plan_with(monkeypatch: pytest.MonkeyPatch, spec: Path, kinds: list[StepKind]) -> Plan:
    monkeypatch.setattr(registry, "kinds", lambda: list(kinds))
    return compile_spec(load_spec(spec).spec)


def steps_of(plan: Plan) -> dict[str, tuple[dict[str, str], str]]:
    return {s.id: (dict(s.inputs), plan.fingerprints[s.id]) for s in plan.steps}


def test_the_registry_order_does_not_change_the_plan(monkeypatch: pytest.MonkeyPatch):
    """Every kind builds after what it reads, so any order of the registry gives the same steps, inputs and
    fingerprints (the registry's order only lists independent steps)."""
    builtin = registry.kinds()
    reference = steps_of(compile_spec(load_spec(TINY).spec))
    rng = random.Random(0)
    for _ in range(5):
        shuffled = rng.sample(builtin, len(builtin))
        assert steps_of(plan_with(monkeypatch, TINY, shuffled)) == reference


@pytest.mark.parametrize("where", ["last", "before evaluate", "first"])
def test_a_new_model_kind_is_evaluated_wherever_it_is_registered(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                                 where: str):
    """A new kind needs its module and one registration: registered after evaluate, before it or first, its model
    is evaluated, curved and nameable by criteria the same way, and `final` stays the newest trained model."""
    evaluation = "  evaluation: {perplexity_sources: [notes]}\n  pretraining:"
    criterion = {"checkpoint: final}": 'checkpoint: "soup:stages"}'}
    spec = write_minimal_spec(tmp_path, **criterion, **{"  pretraining:": evaluation})
    builtin = registry.kinds()
    at = {"last": len(builtin), "first": 0,
          "before evaluate": next(i for i, k in enumerate(builtin) if k.name == "evaluate")}[where]
    plan = plan_with(monkeypatch, spec, [*builtin[:at], SOUP, *builtin[at:]])
    evaluated = {s.inputs["model"] for s in plan.steps if s.kind == "evaluate"}
    assert evaluated == {"pretrain:stage1", "pretrain:stage2", "soup:stages"}
    assert plan.step("soup:stages").inputs == {"models:stage1": "pretrain:stage1", "models:stage2": "pretrain:stage2"}
    curves = plan.step("curves:evaluation")
    assert curves.config.runs == ["pretrain:stage1", "pretrain:stage2", "soup:stages"]
    report = plan.step("report:success")
    assert report.inputs == {"eval:soup:stages": "evaluate:soup-stages"}
    assert report.config.final == "pretrain:stage2"  # evaluated, not advancing: not `final`

    monkeypatch.undo()
    same = plan_with(monkeypatch, spec, [*builtin, SOUP])
    assert steps_of(plan) == steps_of(same)


def test_a_builder_reading_a_kind_it_does_not_build_after_is_refused_with_the_fix(monkeypatch: pytest.MonkeyPatch):
    """Without `after`, a kind registered first would have read no pretraining steps and silently added nothing."""
    careless = replace(SOUP, after=())
    with pytest.raises(BuildOrderError, match="'soup' read the steps of 'pretrain' before its builder ran: add "
                                              "'pretrain' to the `after` of 'soup'"):
        plan_with(monkeypatch, TINY, [careless, *registry.kinds()])


def test_kinds_that_read_each_other_are_a_cycle_named():
    a = StepKind("a", EmptyConfig, _never_run, lambda plan: None, version="1", after=("b",))
    b = StepKind("b", EmptyConfig, _never_run, lambda plan: None, version="1", after=("a",))
    with pytest.raises(BuildCycle, match=r"a \(after b\), b \(after a\)"):
        build_order([a, b])


def test_a_kind_that_trains_on_post_training_builds_after_it_though_post_training_reads_every_model():
    """after_models (post-training continues the newest model) gives way to an explicit `after` the other way."""
    kinds = registry.kinds()
    merge = replace(SOUP, name="merge", after=("post_train",), advances_model=True)
    order = [k.name for k in build_order([merge, *kinds])]
    assert order.index("post_train") < order.index("merge") < order.index("evaluate")
    assert order.index("pretrain") < order.index("long_context") < order.index("post_train")


def test_inputs_flatten_to_the_roles_the_fingerprint_reads():
    @dataclass(frozen=True)
    class Example(Inputs):
        tokenizer: StepRef
        tokens: Mapping[str, StepRef]
        previous: StepRef | None = None

    example = Example(StepRef("tokenizer", "select"), {"web": StepRef("tokenize", "web")})
    assert example.roles() == {"tokenizer": "tokenizer:select", "tokens:web": "tokenize:web"}
    with pytest.raises(TypeError, match=r"Example.tokens\['web'\] is a str, not a StepRef"):
        Example(StepRef("tokenizer", "select"), {"web": "tokenize:web"}).roles()  # type: ignore[dict-item]
    assert StepRef.parse("evaluate:pretrain-stage1") == StepRef("evaluate", "pretrain-stage1")
    with pytest.raises(ValueError, match="not a step id"):
        StepRef.parse("pretrain")


def test_a_step_is_refused_with_inputs_of_another_kind():
    plan = PlanBuilder(load_spec(TINY).spec, registry.kinds())
    with pytest.raises(TypeError, match="soup:x: inputs are a NoInputs, not SoupInputs"):
        plan.add(SOUP, "x", EmptyConfig(), NoInputs())
    with pytest.raises(ValueError, match="step kind 'soup' adds no steps on demand"):
        plan.require("soup", "x")


def test_no_kind_module_imports_another():
    """Kinds learn other kinds' steps from the plan (require, ref, of_kind, tokenizer, the models), never by
    importing their modules; what several kinds share lives in tasks/common/."""
    kinds_dir = REPO / "tasks" / "kinds"
    for path in sorted(kinds_dir.glob("*.py")):
        tree = ast.parse(path.read_text())
        imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}
        imported |= {f"compass.tasks.kinds.{alias.name}" for node in ast.walk(tree)
                     if isinstance(node, ast.ImportFrom) and node.module == "compass.tasks.kinds"
                     for alias in node.names}
        others = {m for m in imported if m.startswith("compass.tasks.kinds.")} - {f"compass.tasks.kinds.{path.stem}"}
        assert not others, f"{path.name} imports {sorted(others)}"


def test_a_step_reads_its_inputs_back_as_its_kind_declared_them(tmp_path: Path):
    """`given()` is the inverse of `roles()` for every step of the example specs that start from random weights
    (every kind but the starting checkpoint's) and the minimal spec: the committed artifacts by role come back in the
    kind's own Inputs class, field for field."""
    specs = [REPO / "specs" / "examples" / "tiny.yaml", REPO / "specs" / "examples" / "smollm3-3b.yaml",
             write_minimal_spec(tmp_path)]
    checked = 0
    for spec in specs:
        plan = compile_spec(load_spec(spec).spec)
        for step in plan.steps:
            kind = registry.kind(step.kind)
            artifacts = {role: ("artifact of", step_id) for role, step_id in step.inputs.items()}
            given = kind.inputs.given(artifacts)
            back = {f.name: _refs(getattr(given, f.name)) for f in fields(given)}
            assert type(step.wired)(**back) == step.wired, step.id
            checked += 1
    assert checked > 50


def _refs(value):
    if value is None:
        return None
    if isinstance(value, Mapping):
        return {key: StepRef.parse(art[1]) for key, art in value.items()}
    return StepRef.parse(value[1])


def test_an_input_a_step_needs_and_was_not_given_is_named():
    from compass.tasks.common.inputs import TrainingInputs

    with pytest.raises(KeyError, match=r"TrainingInputs.tokenizer: the step was given no input 'tokenizer' \(given: "
                                       r"tokens:web\)"):
        TrainingInputs.given({"tokens:web": "web tokens"})
    given = TrainingInputs.given({"tokenizer": "tok", "tokens:web": "web", "tokens:code": "code"})
    assert given.previous is None and given.gate == {} and given.tokens == {"web": "web", "code": "code"}


def test_executors_read_their_inputs_through_their_kinds_inputs_class():
    """No step kind indexes `ctx.inputs` by a role string (`ctx.inputs["previous"]`, `.get`, `.items()`): each asks
    `ctx.given(ItsInputs)`, so a renamed or missing input is a field error, not a KeyError at run time."""
    found = []
    for path in sorted((REPO / "tasks").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr == "inputs" and isinstance(node.value, ast.Name) \
                    and node.value.id == "ctx":
                found.append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert not found, f"ctx.inputs read by role in: {found}"


def test_every_rank_job_carries_how_whole_and_a_job_refuses_a_copy_that_would_change_nothing(tmp_path: Path):
    """The trainer's, TRL's and lighteval's job records carry the spec's `how` one way (the whole of it, as the job
    runs it); a TrainJob's `how` sections read through it, change with with_how, and model_copy refuses a key that
    is not a job field (a `how` section set beside its property would change nothing)."""
    from compass.model.training.job import SpecialIds, StageRecipe, TrainJob
    from compass.specs.how import Checkpoints, Hardware, How
    from compass.specs.training import Monitors, Optimizer, PretrainStage, Schedule
    from compass.tasks.evaluation.lighteval_ranks import LightevalJob
    from compass.tasks.post_training.trl_job import TrlJob

    for job_type in (TrainJob, TrlJob, LightevalJob):
        assert job_type.model_fields["how"].annotation is How, job_type
        assert not {"hardware", "precision", "parallelism", "checkpoints"} & set(job_type.model_fields), job_type
    stage = PretrainStage(name="s", tokens=64, sequence_length=8, global_batch_size=2, mixture={"web": 1.0})
    recipe = StageRecipe(architecture=load_spec(TINY).spec.what.architecture, optimizer=Optimizer(),
                         schedule=Schedule(kind="constant"), stages=[stage], stage="s", seed=0,
                         intra_document_masking=True, monitors=Monitors())
    job = TrainJob(recipe=recipe, workdir=tmp_path, tokenizer_dir=tmp_path, vocab_size=16,
                   special_ids=SpecialIds(eos=0, pad=0), sources={"web": tmp_path}, how=How(precision="bf16"))
    assert (job.precision, job.hardware.accelerator, job.micro_batch_size) == ("bf16", "cpu", 1)
    on_gpu = job.with_how(hardware=Hardware(accelerator="h100"), checkpoints=Checkpoints(every_steps=3))
    assert (on_gpu.hardware.accelerator, on_gpu.checkpoints.every_steps, on_gpu.precision) == ("h100", 3, "bf16")
    assert TrainJob.model_validate_json(on_gpu.model_dump_json()) == on_gpu  # what every rank reads back
    with pytest.raises(TypeError, match=r"with_how\(hardware=\.\.\.\)"):
        job.model_copy(update={"hardware": Hardware(accelerator="h100")})
    with pytest.raises(TypeError, match="not fields of how"):
        job.with_how(hang_timeout_s=5)
    assert job.model_copy(update={"tokens_before": 7}).tokens_before == 7
