"""Every post-training method is one record (specs/post_training_methods.py) that the planner, the checks, the
kind, the TRL ranks and the smoke report read: each method of the spec's literals has its record and builders, the
frozen models the plan counts beside the trained one are those the TRL trainer compass builds holds (ORPO and SimPO
none, DPO and KTO their reference, GKD its teacher), and SimPO, added as a literal value and a record, trains
through the pipeline."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, get_args

import pytest

from compass.flows.compiler import compile_spec
from compass.flows.reports.smoke import exercised
from compass.specs import load_spec
from compass.specs.costs import count_parameters, library_step_memory, planning_vocab
from compass.specs.how import How
from compass.specs.post_training import Distillation, Grpo, MidTraining, PostTrainStep, Preference, Sft
from compass.specs.post_training_methods import METHODS, method_of
from compass.tasks.common.devices import Device
from compass.tasks.kinds.post_train import CONFIGS, ROWS
from compass.tasks.post_training.adapters import with_adapters
from compass.tasks.post_training.chat import load_chat_model
from compass.tasks.post_training.trl_goodput import TrlGoodput
from compass.tasks.post_training.trl_job import TrlJob, TrlSection
from compass.tasks.post_training.trl_ranks import TRAINERS, build_trainer
from tests.conftest import TRL_CHECKPOINTS, seeded, write_minimal_spec

FAMILIES = [m for m in get_args(get_args(PostTrainStep)[0]) if m is not MidTraining]  # TRL's section models
DATASET = "pypi://evals==3.0.1.post1"
# every method, and with LoRA those whose frozen models it changes (TRL disables the adapter for the reference pass)
CASES = [(m.name, lora) for m in METHODS.values() for lora in (False, True) if not lora or m.reference_model]


def test_every_method_of_the_spec_has_one_record_and_a_builder_of_each_kind():
    """The spec's literals and the records name the same methods; each record's section accepts its name, and the
    kind's config and rows and the ranks' trainer are found by that section (a record without them cannot be
    written)."""
    assert list(get_args(get_args(TrlSection)[0])) == FAMILIES  # what a rank job's section may be
    literals = {name: family for family in FAMILIES for name in get_args(family.model_fields["method"].annotation)}
    assert set(literals) == set(METHODS)
    assert "simpo" in literals and literals["simpo"] is Preference
    for name, method in METHODS.items():
        assert method.name == name and literals[name] is method.section
        assert issubclass(CONFIGS[method.section], method.section)
        assert callable(ROWS[method.section]) and callable(TRAINERS[method.section])
        assert set(method.reads) <= set(method.section.model_fields), name
        assert method.paired == (method.section is Preference)


def test_a_method_without_a_record_is_refused_never_trained_as_another():
    """The preference builder once ended in `else: KTO`: a new preference method without its trainer trained KTO."""
    section = Preference.model_construct(method="cpo", name="x", dataset="x", lr=1e-4)
    job = TrlJob.model_construct(step="post_train:x", section=section)
    with pytest.raises(ValueError, match=r"'cpo' has no record .*known: sft, dpo, orpo, kto, simpo"):
        build_trainer(job, None, None, [], None)


def one_step_of_each(lora: bool) -> str:
    """One post-training step of every method (named after it; `_lora` with adapters), each from the same model."""
    peft = ", peft: {kind: lora, r: 4, alpha: 8}" if lora else ""
    suffix = "_lora" if lora else ""
    lines = []
    for method in METHODS.values():
        extra = ", teacher: 'post_train:sft'" if method.section is Distillation else ""
        lines.append(f"    - {{method: {method.name}, name: {method.name}{suffix}, dataset: '{DATASET}', lr: 1.0e-4, "
                     f"batch_size: 4, max_length: 64{extra}{peft}}}\n")
    return "".join(lines)


@pytest.fixture(scope="module")
def every_method(tmp_path_factory: pytest.TempPathFactory):
    """The minimal spec with a step of every method, with and without LoRA: loaded and compiled."""
    folder = tmp_path_factory.mktemp("methods")
    spec = write_minimal_spec(folder, **{"  pretraining:": "  post_training:\n" + one_step_of_each(False) +
                                         one_step_of_each(True) + "  pretraining:"})
    loaded = load_spec(spec).spec
    return loaded, compile_spec(loaded)


TEST_ROWS: dict[type, list[dict[str, Any]]] = {  # rows of each family's shape, as the kind builds them
    Sft: [{"messages": [{"role": "user", "content": f"What is {a} plus {a}?"},
                        {"role": "assistant", "content": f"It is {2 * a}."}]} for a in range(4)],
    Preference: [{"prompt": [{"role": "user", "content": f"What is {a} plus {a}?"}],
                  "chosen": [{"role": "assistant", "content": f"It is {2 * a}."}],
                  "rejected": [{"role": "assistant", "content": "the cat sat"}]} for a in range(4)],
    Grpo: [{"prompt": [{"role": "user", "content": f"{a} + {a} ="}], "question": f"{a} + {a} =", "answer": str(2 * a)}
           for a in range(4)],
}
TEST_ROWS[Distillation] = TEST_ROWS[Sft]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.hub_cache import tiny_llama

    return tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


def built_trainer(section: Any, model_folder: Path, work: Path) -> Any:
    """The TRL trainer compass builds for a step's section on one CPU rank (adapters first, as `train` puts them),
    without training it."""
    method = method_of(section)
    job = TrlJob(step=f"post_train:{section.name}", section=section.model_dump(exclude={"seed", "vibe_prompts"}),
                 seed=0, how=How(), work=work, world=1, device="cpu", bf16=False,
                 teacher=model_folder if method.teacher else None)
    model, tokenizer = load_chat_model(model_folder)
    if section.peft is not None:
        model = with_adapters(model, section.peft, work, Device("cpu", False))
    ledger = TrlGoodput(work / "goodput", time.time(), rank=0)
    trainer, _ = build_trainer(job, model, tokenizer, TEST_ROWS[method.section], ledger)
    return trainer


def frozen_modules(trainer: Any) -> list[str]:
    """The attributes of a TRL trainer holding a model other than the one it trains (its reference, its teacher)."""
    import torch

    trained = (trainer.model, trainer.model_wrapped)
    return sorted(name for name, value in vars(trainer).items()
                  if isinstance(value, torch.nn.Module) and all(value is not m for m in trained))


@pytest.mark.parametrize(("name", "lora"), CASES, ids=[f"{n}{'-lora' if lora else ''}" for n, lora in CASES])
def test_the_frozen_models_planned_are_those_the_trl_trainer_holds(every_method, tiny_model: Path, tmp_path: Path,
                                                                   name: str, lora: bool):
    """`compass plan` counts a frozen copy of the model for each model the trainer holds beside the one it trains:
    what the trainer compass builds holds (its reference, its teacher) is read off it, what the plan counts off the
    step's memory row (the bytes beyond the trained weights and their states, in copies of the model)."""
    spec, plan = every_method
    step = plan.step(f"post_train:{name}{'_lora' if lora else ''}")
    n = count_parameters(spec.what.architecture, planning_vocab(spec)).total
    memory = {m.step: m for m in library_step_memory(spec)}[step.id]
    trained_state = 4 * n if lora else 16 * n  # LoRA: the frozen base; else fp32 weights, gradients, AdamW (1 rank)
    planned = (memory.weights - trained_state) / (4 * n)

    trainer = built_trainer(step.config, tiny_model, tmp_path)
    held = frozen_modules(trainer)
    method = METHODS[name]
    assert type(trainer).__name__ == method.trl_trainer.split(":")[1]
    assert planned == len(held), (name, lora, planned, held)
    assert held == sorted(["ref_model"] * method.frozen_models(lora) + ["teacher_model"] * method.teacher)


def test_orpo_and_simpo_plan_no_reference_model_dpo_and_kto_one(every_method):
    """ORPO was planned with DPO's reference copy it never holds: one model's fp32 weights per GPU too many."""
    spec, _ = every_method
    n = count_parameters(spec.what.architecture, planning_vocab(spec)).total
    weights = {m.step.removeprefix("post_train:"): m.weights for m in library_step_memory(spec)}
    assert weights["orpo"] == weights["simpo"] == weights["sft"] == 16 * n
    assert weights["dpo"] == weights["kto"] == weights["orpo"] + 4 * n
    assert weights["dpo_lora"] == weights["orpo_lora"] == 4 * n  # TRL disables the adapter for DPO's reference


def test_simpo_is_trls_cpo_trainer_with_the_simpo_loss(tiny_model: Path, tmp_path: Path):
    """SimPO: CPOTrainer with loss_type simpo and no behaviour-cloning term; the spec's beta and simpo_gamma reach
    it, and without simpo_gamma TRL's default margin stands."""
    section = Preference(method="simpo", name="simpo", dataset="x", lr=1e-4, batch_size=2, max_length=64, beta=2.0,
                         simpo_gamma=0.7)
    trainer = built_trainer(section, tiny_model, tmp_path / "gamma")
    assert (trainer.loss_type, trainer.cpo_alpha, trainer.beta, trainer.simpo_gamma) == ("simpo", 0.0, 2.0, 0.7)
    default = built_trainer(section.model_copy(update={"simpo_gamma": None}), tiny_model, tmp_path / "default")
    assert default.simpo_gamma == 0.5


def test_simpo_gamma_stays_out_of_other_steps_identity_and_the_report_says_the_trainer(every_method):
    """A field added for SimPO leaves every other step's identity as it was (None is left out); the smoke report
    names each method's TRL trainer from its record."""
    spec, plan = every_method
    for method in ("dpo", "orpo", "kto", "simpo"):
        assert "simpo_gamma" not in plan.step(f"post_train:{method}").config.identity()
    gamma = plan.step("post_train:simpo").config.model_copy(update={"simpo_gamma": 1.0})
    assert gamma.identity()["simpo_gamma"] == 1.0
    said = {m: exercised(plan.step(f"post_train:{m}"), spec) for m in ("dpo", "orpo", "kto", "simpo", "distill")}
    assert said == {"dpo": "TRL DPO (sigmoid)", "orpo": "TRL ORPO", "kto": "TRL KTO",
                    "simpo": "TRL SimPO (CPOTrainer)", "distill": "TRL GKD"}


def test_a_field_of_another_preference_method_is_refused_where_it_stands(tmp_path: Path):
    from compass.specs.loader import SpecError

    steps = ("  post_training:\n"
             f"    - {{method: dpo, name: dpo, dataset: '{DATASET}', lr: 1.0e-4, simpo_gamma: 0.5}}\n"
             f"    - {{method: simpo, name: simpo, dataset: '{DATASET}', lr: 1.0e-4, loss_type: ipo}}\n"
             f"    - {{method: orpo, name: orpo, dataset: '{DATASET}', lr: 1.0e-4, loss_type: ipo}}\n"
             "  pretraining:")
    spec = write_minimal_spec(tmp_path, **{"  pretraining:": steps})
    with pytest.raises(SpecError) as info:
        load_spec(spec)
    said = sorted(str(p).removeprefix(f"{spec}:") for p in info.value.problems)
    assert said == [
        "45: what.post_training[0].simpo_gamma: simpo_gamma has no effect here: only simpo reads it, not dpo "
        "(remove simpo_gamma)",
        "46: what.post_training[1].loss_type: loss_type has no effect here: only dpo reads it, not simpo "
        "(remove loss_type)",
        "47: what.post_training[2].loss_type: loss_type has no effect here: only dpo reads it, not orpo "
        "(remove loss_type)"]


PAIRS = [{"prompt": f"What is {a} + {a}?", "chosen": str(2 * a), "rejected": f"the cat {a}"} for a in range(16)]
SIMPO = ("  post_training:\n"  # a short SFT first: the chat model whose margins SimPO moves
         f"    - {{method: sft, name: sft, dataset: '{DATASET}', lr: 1.0e-3, max_samples: 8, max_length: 128,\n"
         "       batch_size: 4}\n"
         "    - {method: simpo, name: simpo, dataset: prefs, lr: 1.0e-3, beta: 2.0, simpo_gamma: 0.5, batch_size: 4,\n"
         "       max_length: 64}\n"
         "  pretraining:")


@pytest.mark.slow
def test_simpo_trains_through_the_pipeline_without_a_reference_model(trl_trained_store: Path, tmp_path: Path):
    """A spec with `method: simpo` compiles, plans no reference model, and its post_train step trains on the
    dataset's pairs from the pretrained model (the session's), raising the chosen answers over the rejected ones,
    and commits its artifact."""
    from compass.flows.reports.plan_status import plan_status
    from compass.infra.store import Store
    from tests.conftest import run_up_to
    from tests.test_post_training import preference_margin

    (tmp_path / "prefs").mkdir()
    (tmp_path / "prefs" / "pairs.jsonl").write_text("".join(json.dumps(p) + "\n" for p in PAIRS))
    spec_path = write_minimal_spec(tmp_path, **{"  pretraining:": SIMPO, "how:\n": TRL_CHECKPOINTS})
    spec = load_spec(spec_path).spec
    n = count_parameters(spec.what.architecture, planning_vocab(spec)).total
    (row,) = [m for m in library_step_memory(spec) if m.step == "post_train:simpo"]
    assert (row.weights, row.micro_batch) == (16 * n, 4)  # no reference model beside the trained weights

    store = seeded(tmp_path / "store", trl_trained_store)
    plan, outcomes = run_up_to(spec_path, "post_train:simpo", store)
    assert not any(o.executed for sid, o in outcomes.items() if sid.startswith("pretrain:"))  # the session's
    simpo = outcomes["post_train:simpo"]
    metrics = simpo.manifest.metrics
    assert simpo.executed and metrics["method"] == "simpo" and metrics["pairs"] == 16
    assert metrics["steps"] == 4 and metrics["final_loss"] is not None
    assert simpo.manifest.config["simpo_gamma"] == 0.5 and simpo.manifest.config["beta"] == 2.0
    statuses = {s.step_id: s.state for s in plan_status(plan, Store(str(store)))}
    assert statuses["post_train:simpo"] == "cached"  # committed: the plan finds it in the store

    pairs = [json.loads(line) for line in (Path(simpo.uri) / "pairs.jsonl").read_text().splitlines()]
    previous = {i.role: i.uri for i in simpo.manifest.inputs}["previous"]
    assert previous == outcomes["post_train:sft"].uri
    before = preference_margin(Path(previous) / "final", pairs)
    after = preference_margin(Path(simpo.uri) / "final", pairs)
    assert after > before, (before, after)
