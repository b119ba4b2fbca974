"""bf16 as the production specs train, rehearsed on CPU ranks: DeepSpeed holds bf16 weights, so the start-of-run
checks (every rank's weights digested and compared, tensor-parallel shards gathered against the initialisation)
read bf16 tensors and compare them in the dtype the engine holds. Before, every DeepSpeed bf16 run of more than one
rank crashed before its first step (numpy has no bfloat16). The run itself, 2 x 2 bf16 DeepSpeed ranks with TP 2, is
rehearsed on the emulated GPU cluster (tests/test_rehearsal_cluster.py)."""

from __future__ import annotations

import pytest
import torch

from compass.model.training.engines import tensors_digest
from compass.model.training.rank_checks import gathered_mismatch, state_digests
from compass.model.training.trainer import autocast, held_dtype


def test_digests_read_any_dtype_and_tell_dtypes_apart():
    weights = torch.randn(4, 8)
    half = weights.to(torch.bfloat16)
    assert tensors_digest([half]) == tensors_digest([half.clone()])
    assert tensors_digest([half]) != tensors_digest([weights])  # the same numbers held in another dtype
    assert tensors_digest([half]) != tensors_digest([(half * 2)])
    assert tensors_digest([torch.zeros(3, dtype=torch.float16)]) != tensors_digest([torch.zeros(3, dtype=torch.int16)])
    assert tensors_digest([torch.tensor(1.5, dtype=torch.bfloat16), torch.tensor([True])]) > 0  # 0-d, bool


def test_shards_are_compared_in_the_dtype_the_engine_holds():
    initial = {"q": torch.randn(8, 4), "steps": torch.tensor([3])}
    held = held_dtype(deepspeed=True, precision="bf16")
    assert held == torch.bfloat16 and held_dtype(deepspeed=False, precision="bf16") == torch.float32
    digests = state_digests(initial, held)
    gathered = {"q": initial["q"].to(torch.bfloat16), "steps": initial["steps"]}  # what DeepSpeed's bf16 engine gives
    assert gathered_mismatch(digests, gathered, held) == []
    assert gathered_mismatch(digests, {**gathered, "q": gathered["q"] + 1}, held) == ["q"]
    assert gathered_mismatch(state_digests(initial), gathered) == ["q"]  # compared in fp32: every bf16 tensor differs


def test_the_torch_engine_computes_in_bf16_on_cpu_ranks_too():
    """A rehearsal's CPU ranks of a bf16 spec compute in bf16, as on the GPU (before: autocast on CUDA only, so a
    rehearsal trained fp32 and proved nothing of bf16)."""
    a, b = torch.randn(4, 4), torch.randn(4, 4)
    with autocast(torch.device("cpu"), "bf16", torch_engine=True):
        assert (a @ b).dtype == torch.bfloat16
    with autocast(torch.device("cpu"), "bf16", torch_engine=False):  # DeepSpeed holds bf16 weights itself
        assert (a @ b).dtype == torch.float32
    with autocast(torch.device("cpu"), "fp32", torch_engine=True):
        assert (a @ b).dtype == torch.float32


def test_fp16_without_deepspeed_is_refused_not_trained_in_fp32(tmp_path):
    from compass.flows.validation import load_checked
    from compass.specs.loader import SpecError
    from tests.conftest import write_minimal_spec

    how = "how:\n  hardware: {accelerator: h100}\n  precision: fp16\n  parallelism: {micro_batch_size: 2"
    spec = write_minimal_spec(tmp_path, **{"how:\n  parallelism: {micro_batch_size: 2": how + ", engine: fsdp2"})
    with pytest.raises(SpecError, match=r"how.precision: fp16 trains only under DeepSpeed .*the fsdp2 engine"):
        load_checked(spec, machine=False)
    spec.write_text(spec.read_text().replace(", engine: fsdp2", ", zero_stage: 1"))
    load_checked(spec, machine=False)  # DeepSpeed's loss scaler: accepted (fp32 sums from ZeRO-1 up)
