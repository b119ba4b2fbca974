"""The device post-training and evaluation compute on, from `how`: the GPU when the spec asks for one and CUDA is
here, else the CPU (a CPU spec, or a rehearsal's CPU rank). A GPU spec's precision holds on either: a rehearsal's
TRL and lighteval models compute in bf16 on the CPU (slower there than fp32, but the arithmetic and the DeepSpeed
bf16 path the cluster will run); a CPU spec computes in fp32. Where the step itself runs is its placement
(tasks/steps/placement.py)."""

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
    gpu_spec = how.hardware.accelerator != "cpu"
    return Device("cuda" if gpu_spec and torch.cuda.is_available() else "cpu", gpu_spec and how.precision == "bf16")


def cpu_substitutions(how: How) -> list[str]:
    """What a GPU spec's TRL or lighteval model gives up on a rank without CUDA (a rehearsal's CPU node): flash-attn,
    which needs CUDA, for SDPA. The step's manifest records it (`setup.substituted`), and a rehearsal's table says
    it, as the trainer's CPU ranks say which CUDA-only kernels they replaced. Its precision it keeps."""
    import torch

    if how.hardware.accelerator == "cpu" or torch.cuda.is_available() or how.attention != "flash":
        return []
    return ["attention flash -> sdpa (a library's model on a CPU rank: flash-attn needs CUDA)"]


def setup_of(how: How) -> dict[str, object]:
    """The device, dtype and substitutions a library step's model ran with, for its manifest's metrics."""
    where = device_for(how)
    return {"device": where.device, "precision": where.dtype, "substituted": cpu_substitutions(how)}


# varlen: a library's rows are padded, not packed, and carry no cumulative lengths: torch's SDPA with their mask
HF_ATTENTION = {"flash": "flash_attention_2", "varlen": "sdpa", "flex": "flex_attention", "sdpa": "sdpa",
                "eager": "eager"}


def hf_attention(how: How, device: str) -> str | None:
    """transformers' attn_implementation for how.attention on a library's model (TRL, lighteval) on `device`; None
    for `auto`: the library's default (SDPA), since their batches are padded rows, not compass's packed documents.
    flash on a CPU rank is SDPA (cpu_substitutions says so)."""
    if device == "cpu" and how.attention == "flash":
        return "sdpa"
    return HF_ATTENTION.get(how.attention)


def require_vllm(step: str) -> None:
    """vLLM is optional (GPU nodes only): its absence is named, with the fix, before any work."""
    if importlib.util.find_spec("vllm") is None:
        raise RuntimeError(f"{step}: how.generation is vllm and the vllm package is not installed on this node "
                           "(pip install vllm in the environment the steps run in, or use generation: transformers)")
