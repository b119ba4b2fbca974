"""The one place a rank learns which device it computes on, from what the launcher and Slurm give it.

torchrun, DeepSpeed's launcher and `srun` (compass launches it with `--gpus-per-node` and no GPU binding) all let
every rank of a node see the node's GPUs (CUDA_VISIBLE_DEVICES, set by Slurm from the job's GPUs): a rank opens the
one at its local rank, `cuda:LOCAL_RANK`, which is also what DeepSpeed, DDP, the device mesh and accelerate pick
by themselves. A rank that sees exactly one GPU (a task Slurm bound to its own GPU: `--gpus-per-task=1`, a site's
default `--gpu-bind`) opens that one, `cuda:0`, and only when it is its node's only rank: the libraries above would
open `cuda:LOCAL_RANK` beside it. Anything else is refused here, naming what the rank saw, instead of an "invalid
device ordinal" or two ranks on one GPU at the first collective.

On a machine without CUDA (the tests, a rehearsal on CPU ranks) the same resolution runs: the rank records the GPU
it would open, so a rehearsal under an emulated Slurm checks every rank's device, and computes on the CPU. Only a
rehearsal may: a GPU spec's rank elsewhere without CUDA is refused (`refuse_cpu_ranks`).
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass


@dataclass(frozen=True)
class RankDevice:
    """Where one rank computes, and which GPU it opens (or would open, on a machine without CUDA)."""

    type: str  # "cuda" where CUDA computes, else "cpu"
    index: int | None  # the GPU's ordinal among the GPUs this process sees; None without GPUs
    gpu: str | None  # the GPU as its node names it: its entry in CUDA_VISIBLE_DEVICES (all of the node's: the index)
    local_rank: int
    node: str  # the node as the scheduler names it (SLURMD_NODENAME), else the host name
    visible: tuple[str, ...] | None = None  # CUDA_VISIBLE_DEVICES as the rank saw it; None when unset

    @property
    def torch_device(self) -> str:
        return f"cuda:{self.index}" if self.type == "cuda" else "cpu"

    def describe(self) -> str:
        if self.index is None:
            return self.type
        opened = f"cuda:{self.index} (GPU {self.gpu})"
        return opened if self.type == "cuda" else f"cpu (would open {opened})"


REHEARSAL_ENV = "COMPASS_REHEARSAL"  # "1" in a rehearsal's jobs (`--rehearse`; the tests' emulated GPU clusters)


class DeviceError(RuntimeError):
    """A rank cannot tell which GPU is its own, or has none."""


def refuse_cpu_ranks(accelerator: str, cuda_available: bool, env: dict[str, str] | None = None) -> None:
    """A GPU spec's rank where CUDA is not available computes on the CPU only in a rehearsal. Elsewhere it is a
    node whose driver, job or torch build lost its GPUs, and a weeks-long run would train on its CPU without a word."""

    env = dict(os.environ if env is None else env)
    if accelerator == "cpu" or cuda_available or env.get(REHEARSAL_ENV) == "1":
        return
    node = env.get("SLURMD_NODENAME") or socket.gethostname()
    raise DeviceError(f"rank {env.get('RANK', 0)} on {node}: how.hardware.accelerator is {accelerator} but CUDA is "
                      "not available here (no driver, no GPU given to the job, or a CPU-only torch build): check the "
                      "node with nvidia-smi and leave it out (how.orchestration.cluster.exclude), or rehearse the "
                      "run on CPU nodes with `compass run --rehearse`")


def visible_gpus(env: dict[str, str] | None = None) -> list[str] | None:
    """The GPUs this process may open, as named in CUDA_VISIBLE_DEVICES; None when it is not set (every GPU)."""
    value = (os.environ if env is None else env).get("CUDA_VISIBLE_DEVICES")
    if value is None:
        return None
    return [g.strip() for g in value.split(",") if g.strip() and g.strip() != "NoDevFiles"]


def resolve(accelerator: str, cuda_available: bool | None = None, env: dict[str, str] | None = None) -> RankDevice:
    """This rank's device: a GPU when `accelerator` names one (how.hardware.accelerator), the CPU otherwise.
    `cuda_available` None: ask torch."""

    env = dict(os.environ if env is None else env)
    local_rank = int(env.get("LOCAL_RANK", 0))
    local_world = int(env.get("LOCAL_WORLD_SIZE") or env.get("LOCAL_SIZE") or 1)
    node = env.get("SLURMD_NODENAME") or socket.gethostname()
    if accelerator == "cpu":
        return RankDevice("cpu", None, None, local_rank, node)
    visible = visible_gpus(env)
    if cuda_available is None:
        import torch

        cuda_available = torch.cuda.is_available()
    if visible is None:  # nothing restricts it: the node's GPUs, in order
        index, gpu = local_rank, str(local_rank)
    elif len(visible) == 1 and local_world == 1:
        index, gpu = 0, visible[0]
    elif local_rank < len(visible) and len(visible) >= local_world:
        index, gpu = local_rank, visible[local_rank]
    elif not visible:
        raise DeviceError(f"rank {env.get('RANK', 0)} on {node} sees no GPU (CUDA_VISIBLE_DEVICES is empty) and "
                          f"how.hardware.accelerator is {accelerator}: the job was given no GPUs (Slurm: --gpus-"
                          "per-node), or set accelerator: cpu")
    else:
        raise DeviceError(f"local rank {local_rank} of {local_world} on {node} sees GPUs {','.join(visible)} "
                          f"(CUDA_VISIBLE_DEVICES): each rank must see its node's GPUs, one per rank (Slurm bound "
                          "GPUs per task: launch with --gpus-per-node and no --gpu-bind, as compass's srun does, "
                          "or give the node as many GPUs as ranks)")
    return RankDevice("cuda" if cuda_available else "cpu", index, gpu, local_rank, node,
                      None if visible is None else tuple(visible))


def gpu_index() -> int:
    """The ordinal of this rank's GPU among those it sees (NCCL's collectives, a CUDA rank's tensors)."""
    index = resolve("cuda", cuda_available=True).index
    assert index is not None
    return index
