"""The device post-training and evaluation compute on, from `how`: the GPU with bf16 autocast when the spec asks
for a GPU and bf16 and CUDA is here; otherwise the CPU in fp32 (bf16 on CPU is slower than fp32, and is refused
there). Where the step itself runs is its placement (tasks/steps/placement.py)."""

from __future__ import annotations

from dataclasses import dataclass

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

    cuda = how.hardware.accelerator != "cpu" and torch.cuda.is_available()
    return Device("cuda" if cuda else "cpu", cuda and how.precision == "bf16")


HF_ATTENTION = {"flash": "flash_attention_2", "flex": "flex_attention", "sdpa": "sdpa", "eager": "eager"}


def hf_attention(how: How) -> str | None:
    """transformers' attn_implementation for how.attention on a library's model (TRL, lighteval); None for `auto`:
    the library's default (SDPA), since their batches are padded rows, not compass's packed documents."""
    return HF_ATTENTION.get(how.attention)
