"""The device post-training and evaluation compute on, from `how`: the GPU with bf16 autocast when the spec asks
for a GPU and bf16 and CUDA is here; otherwise the CPU in fp32 (bf16 on CPU is slower than fp32, and is refused
there). Where the step itself runs is its placement (tasks/steps/placement.py)."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

from compass.model.training.rank_device import refuse_cpu_ranks
from compass.specs.how import How


@dataclass(frozen=True)
class Device:
    device: str  # "cuda" or "cpu"
    bf16: bool

    @property
    def dtype(self) -> str:
        return "bfloat16" if self.bf16 else "float32"


def device_for(how: How) -> Device:
    import torch


    refuse_cpu_ranks(how.hardware.accelerator, torch.cuda.is_available())  # a GPU spec on the CPU: rehearsals only
    cuda = how.hardware.accelerator != "cpu" and torch.cuda.is_available()
    return Device("cuda" if cuda else "cpu", cuda and how.precision == "bf16")


def cpu_substitutions(how: How) -> list[str]:
    """What a GPU spec's TRL or lighteval model gives up on a rank without CUDA (a rehearsal's CPU node): bf16, run
    in fp32 there. The step's manifest records it (`setup.substituted`), and a rehearsal's table says it, as the
    trainer's CPU ranks say which CUDA-only kernels they replaced."""
    import torch

    if how.hardware.accelerator == "cpu" or how.precision == "fp32" or torch.cuda.is_available():
        return []
    return [f"precision {how.precision} -> fp32 (a library's model on a CPU rank)"]


def setup_of(how: How) -> dict[str, object]:
    """The device, dtype and substitutions a library step's model ran with, for its manifest's metrics."""
    where = device_for(how)
    return {"device": where.device, "precision": where.dtype, "substituted": cpu_substitutions(how)}


# varlen: a library's rows are padded, not packed, and carry no cumulative lengths: torch's SDPA with their mask
HF_ATTENTION = {"flash": "flash_attention_2", "varlen": "sdpa", "flex": "flex_attention", "sdpa": "sdpa",
                "eager": "eager"}


def hf_attention(how: How) -> str | None:
    """transformers' attn_implementation for how.attention on a library's model (TRL, lighteval); None for `auto`:
    the library's default (SDPA), since their batches are padded rows, not compass's packed documents."""
    return HF_ATTENTION.get(how.attention)


def require_vllm(step: str) -> None:
    """vLLM is optional (GPU nodes only): its absence is named, with the fix, before any work."""
    if importlib.util.find_spec("vllm") is None:
        raise RuntimeError(f"{step}: how.generation is vllm and the vllm package is not installed on this node "
                           "(pip install vllm in the environment the steps run in, or use generation: transformers)")
