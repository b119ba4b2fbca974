"""Every `how` field that concerns a TRL step reaches TRL's arguments: the checkpoint cadence and how many to keep,
the global batch split over the ranks, activation checkpointing, Liger's loss, torch.compile, bf16 and the backend
of the ranks' group; how.attention picks the model's attention kernel."""

from __future__ import annotations

from pathlib import Path

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
    assert plain["per_device_train_batch_size"] == 16 and plain["ddp_backend"] == "gloo" and plain["use_cpu"]
    assert not (plain["activation_checkpointing"] or plain["use_liger_kernel"] or plain["torch_compile"])


def test_how_attention_names_the_kernel_of_library_models():
    from compass.tasks.common.devices import hf_attention

    assert hf_attention(How(attention="eager")) == "eager" and hf_attention(How(attention="sdpa")) == "sdpa"
    assert hf_attention(How()) is None  # auto: the library's default
