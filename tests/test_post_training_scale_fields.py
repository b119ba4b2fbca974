"""Every `how` field that concerns a TRL step reaches TRL's arguments: the checkpoint cadence and how many to keep,
the global batch split over the ranks, activation checkpointing, Liger's loss, torch.compile, bf16 and the backend
of the ranks' group; how.attention picks the model's attention kernel."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from compass.specs.how import How
from compass.specs.post_training import Sft
from compass.tasks.post_training.trl_job import TrlJob
from compass.tasks.post_training.trl_ranks import common_args


def job(how: How, world: int, device: str = "cpu") -> TrlJob:
    section = Sft(method="sft", name="sft", dataset="chats", lr=1e-4, batch_size=16)
    return TrlJob(step="post_train:sft", section=section, seed=3, how=how, work=Path("/shared/work"), world=world,
                  device=device, bf16=device == "cuda")


def test_how_reaches_trls_arguments():
    how = How.model_validate({"checkpoints": {"every_steps": 50, "keep_last": 3},
                              "parallelism": {"activation_checkpointing": True}, "loss": "liger", "compile": True})
    args = common_args(job(how, world=4, device="cuda"))
    assert args["save_strategy"] == "steps" and args["save_steps"] == 50
    assert args["output_dir"] == "/shared/work/trl-checkpoints"  # on the shared root, where a requeued job looks
    assert args["per_device_train_batch_size"] == 4  # the global batch of 16 over 4 ranks
    assert args["activation_checkpointing"] and args["use_liger_kernel"] and args["torch_compile"]
    assert args["bf16"] and args["ddp_backend"] == "nccl" and not args["use_cpu"] and args["seed"] == 3
    plain = common_args(job(How(), world=1))
    assert plain["per_device_train_batch_size"] == 16 and "ddp_backend" not in plain and plain["use_cpu"]
    assert common_args(job(How(), world=2))["ddp_backend"] == "gloo"
    assert not (plain["activation_checkpointing"] or plain["use_liger_kernel"] or plain["torch_compile"])
    assert "deepspeed" not in plain and "deepspeed" not in common_args(job(How(), world=2))  # ZeRO 0: plain DDP
    zero3 = common_args(job(How.model_validate({"parallelism": {"zero_stage": 3}}), world=2))["deepspeed"]
    assert zero3["zero_optimization"] == {"stage": 3, "stage3_gather_16bit_weights_on_model_save": True}
    assert "optimizer" not in zero3 and "scheduler" not in zero3  # the Trainer's AdamW and schedule, as without it
    alone = common_args(job(How.model_validate({"parallelism": {"zero_stage": 2}}), world=1))
    assert "deepspeed" not in alone  # one rank has nothing to shard


def test_how_attention_names_the_kernel_of_library_models():
    from compass.tasks.common.devices import hf_attention

    assert hf_attention(How(attention="eager"), "cuda") == "eager"
    assert hf_attention(How(attention="sdpa"), "cpu") == "sdpa"
    assert hf_attention(How(), "cuda") is None  # auto: the library's default
    flash = How(attention="flash")
    assert hf_attention(flash, "cuda") == "flash_attention_2" and hf_attention(flash, "cpu") == "sdpa"  # needs CUDA


def test_chat_examples_from_the_index_are_those_of_a_full_parse(tmp_path: Path, monkeypatch):
    """The conversation index (built once per dataset) picks exactly what parsing every line picks, for any seed and
    cap, lines split where Python's universal newlines split them; an edited file is indexed again."""
    import json

    import numpy as np

    from compass.tasks.post_training.datasets import _conversation, chat_examples

    monkeypatch.setenv("COMPASS_CACHE", str(tmp_path / "cache"))
    data = tmp_path / "chats"
    data.mkdir()
    rows = [{"input": [{"role": "user", "content": f"question {i} é" + "x" * (i % 7)}], "ideal": f"answer {i}"}
            for i in range(40)]
    text = "".join(json.dumps(r, ensure_ascii=False) + ("\r\n" if i % 5 else "\n") for i, r in enumerate(rows))
    (data / "a.jsonl").write_text(text + "not json\n" + json.dumps({"messages": "no"}) + "\n", encoding="utf-8")

    def full_parse(limit, seed, max_chars):
        lines = (data / "a.jsonl").read_text(encoding="utf-8").splitlines()
        found = [m for m in map(_conversation, lines) if m and sum(len(x["content"]) for x in m) <= max_chars]
        found = [found[i] for i in np.random.default_rng(seed).permutation(len(found))]
        return found[:limit] if limit else found

    for limit, seed, max_chars in [(None, 0, 1000), (7, 1, 1000), (5, 2, 26)]:
        assert chat_examples(data, limit, seed, max_chars) == full_parse(limit, seed, max_chars)
        assert chat_examples(data, limit, seed, max_chars) == full_parse(limit, seed, max_chars)  # from the index
    with open(data / "a.jsonl", "a", encoding="utf-8") as f:
        f.write(json.dumps({"messages": [{"role": "user", "content": "new"}, {"role": "assistant", "content": "row"}]})
                + "\n")
    assert chat_examples(data, None, 0, 1000) == full_parse(None, 0, 1000)
    assert len(chat_examples(data, None, 0, 1000)) == 41


def test_plan_sizes_each_trl_step_and_passkey_per_gpu():
    """`compass plan` shows each TRL step's share of its global batch and its memory per GPU, the frozen models
    beside the trained one counted (DPO's reference), and passkey's memory without full-vocabulary logits."""
    from compass.specs import load_spec
    from compass.specs.costs import library_step_memory
    from tests.conftest import REPO

    spec = load_spec(REPO / "specs" / "examples" / "tiny.yaml").spec
    two = spec.model_copy(update={"how": spec.how.model_copy(update={"resources": spec.how.resources.model_copy(
        update={"post_training": spec.how.resources.post_training.model_copy(update={"devices_per_node": 2})})})})
    one, split = {m.step: m for m in library_step_memory(spec)}, {m.step: m for m in library_step_memory(two)}
    sft, apo = one["post_train:sft"], one["post_train:apo"]
    assert (sft.ranks, sft.per_rank) == (1, sft.global_batch) and split["post_train:sft"].per_rank == sft.per_rank // 2
    assert split["post_train:sft"].activations < sft.activations and split["post_train:sft"].logits < sft.logits
    assert apo.weights > sft.weights  # the reference model beside the trained one
    n = sft.weights / 16  # full fine-tuning: 16 bytes per parameter on one rank
    for zero, per_parameter in ((1, 4 + 4 + 8 / 2), (2, 4 + 4 / 2 + 8 / 2), (3, 16 / 2)):
        par = two.how.parallelism.model_copy(update={"zero_stage": zero})
        sharded = two.model_copy(update={"how": two.how.model_copy(update={"parallelism": par})})
        assert {m.step: m for m in library_step_memory(sharded)}["post_train:sft"].weights == n * per_parameter
    passkey = one["evaluate: passkey"]
    assert passkey.logits == 0 and passkey.length == max(s.sequence_length for s in spec.what.long_context.stages)


def test_packed_sft_keeps_conversations_apart(tmp_path: Path):
    """SFT with `packing: true` flattens a batch's conversations into one row (TRL's padding-free packing): every
    conversation's logits there equal its logits alone, as the model sees it in training (the collator's position
    ids and sequence lengths passed as the Trainer passes them), so no conversation attends to another."""
    import torch

    from compass.tasks.post_training.chat import load_chat_model
    from compass.tasks.post_training.trl_goodput import TrlGoodput
    from compass.tasks.post_training.trl_ranks import sft_trainer
    from tests.hub_cache import tiny_llama

    model, tokenizer = load_chat_model(tiny_llama(tmp_path / "model"))
    rows = [{"messages": [{"role": "user", "content": f"What is {a} plus {a}?"},
                          {"role": "assistant", "content": f"It is {2 * a}."}]} for a in range(6)]
    section = Sft(method="sft", name="sft", dataset="x", lr=1e-4, batch_size=2, packing=True, max_length=128)
    packed_job = TrlJob(step="post_train:sft", section=section, seed=0, how=How(), work=tmp_path / "work", world=1,
                        device="cpu", bf16=False)
    trainer, _ = sft_trainer(packed_job, model, tokenizer, rows, TrlGoodput(tmp_path / "goodput", time.time(), rank=0))
    # issue 73, H3: compass's document attention, which builds no [L, L] mask (transformers' SDPA would)
    from compass.model.attention import DOCUMENT_SDPA

    assert model.config._attn_implementation == DOCUMENT_SDPA
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(len(trainer.train_dataset))])
    starts = (batch["position_ids"][0] == 0).nonzero().flatten().tolist()
    assert batch["input_ids"].shape[0] == 1 and len(starts) == len(rows)  # one row holding every conversation
    model.eval()
    with torch.no_grad():
        packed = model(**{k: v for k, v in batch.items() if k != "labels"}).logits[0]
        for begin, end in zip(starts, [*starts[1:], batch["input_ids"].shape[1]], strict=True):
            alone = model(input_ids=batch["input_ids"][:, begin:end]).logits[0]
            assert torch.allclose(alone, packed[begin:end], atol=1e-5)


def test_micro_batches_accumulate_to_the_global_batch(tmp_path: Path):
    """A rank's share of the global batch in micro_batch_size passes that accumulate trains like one pass over it:
    the same optimizer steps and the same loss curve."""
    from compass.tasks.post_training.chat import load_chat_model
    from compass.tasks.post_training.trl_ranks import train
    from tests.hub_cache import tiny_llama

    folder = tiny_llama(tmp_path / "model")
    rows = [{"messages": [{"role": "user", "content": f"What is {a} plus {a}?"},
                          {"role": "assistant", "content": f"It is {2 * a}."}]} for a in range(16)]
    curves = {}
    for micro in (None, 2):
        model, tokenizer = load_chat_model(folder)
        section = Sft(method="sft", name="sft", dataset="x", lr=1e-3, batch_size=4, micro_batch_size=micro)
        run = TrlJob(step="post_train:sft", section=section, seed=0, how=How(), work=tmp_path / f"work-{micro}",
                     world=1, device="cpu", bf16=False)
        if micro:
            assert common_args(run)["per_device_train_batch_size"] == 2
            assert common_args(run)["gradient_accumulation_steps"] == 2
        trainer, result = train(run, model, tokenizer, rows, started_at=time.time())
        curves[micro] = [h["loss"] for h in result.log_history if "loss" in h]
        assert result.global_step == 4 and result.goodput is not None and result.goodput.attempts == 1
    assert curves[2] == pytest.approx(curves[None], rel=1e-4)
