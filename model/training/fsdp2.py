"""The FSDP2 engine (`how.parallelism.engine: fsdp2`): torch's `fully_shard` on every transformer block and on the
whole model, so parameters, gradients and AdamW's states live sharded over the data-parallel ranks (what ZeRO-3
shards), gathered block by block for the forward and backward; with `shard_group`, sharded within groups of ranks
and replicated across them (HSDP on a 2-D mesh); with `tensor_parallel`, every block's projections split over
groups of adjacent ranks first (DTensor, tensor_plan.py) and those slices sharded over the data-parallel ranks.
bf16 on GPUs is FSDP2's mixed-precision policy: bf16 compute, fp32 master weights and fp32 gradient reduction.

Checkpoints are torch.distributed.checkpoint's: every rank writes its own shards, staged to host memory by
`async_save` and written on a thread over a gloo group of their own (the training group goes on with the next step),
into the checkpoint's temporary folder; the trainer commits the folder once every rank's files are on disk. A
checkpoint holds shards with their global layout, so DCP can reshard it on load."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from compass.infra.layout import WEIGHTS
from compass.model.training import collectives
from compass.model.training.checkpoints import HostStaging, Write, to_host
from compass.model.training.engines import adamw, clipped_step, gradients_in_words, hf_state, tensors_digest
from compass.specs.training import Optimizer

SHARDS = "dcp"  # the checkpoint's sub-folder of DCP files (`__<rank>_<n>.distcp`, `.metadata`)
EXTRA = "extra.pt"  # rank 0's trainer state (data positions, RNG, callbacks), as the torch engine keeps it


class FSDP2Engine:
    name = "fsdp2"

    def __init__(self, model: torch.nn.Module, groups_of: Callable[[torch.nn.Module], list[dict]], opt: Optimizer,
                 accumulation: int, precision: str, shard_group: int | None = None,
                 reshard_after_forward: bool = True, tensor_parallel: int = 1, reduce_precision: str = "fp32",
                 device: torch.device | None = None):
        """`model` may be on the host with `device` a GPU (the trainer's way): tensor parallelism and fully_shard
        move each block's weights to the device as they split them, so a rank's GPU never holds the whole fp32
        model, only its shards and one block's weights at a time."""
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        device = device or next(model.parameters()).device
        collectives.group_of_one("nccl" if device.type == "cuda" else "gloo")  # the mesh needs a group, even of one
        mesh, data_mesh, self.sharding = _meshes(device.type, collectives.world_size(), shard_group, tensor_parallel)
        if tensor_parallel > 1:
            from compass.model.training.tensor_plan import parallelize_blocks

            parallelize_blocks(model.hf, mesh["tp"])
        self.initial_digest = _whole_digest(model)  # before sharding: every rank of a TP rank's column built it
        reduce = torch.bfloat16 if reduce_precision == "bf16" else torch.float32  # how.reduce_precision
        policy = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=reduce)  # a rehearsal's CPU ranks
                  if precision == "bf16" else MixedPrecisionPolicy())  # too: bf16 rehearsed, not fp32
        # the sharded gradients are the fp32 parameters' own: micro-batches accumulate there in fp32
        self.gradients = gradients_in_words(torch.float32, reduce if precision == "bf16" else torch.float32)
        for block in model.hf.model.layers:
            fully_shard(block, mesh=data_mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward)
        fully_shard(model, mesh=data_mesh, mp_policy=policy)  # embeddings, final norm and head: the root's unit
        self.module = model.to(device)  # what no unit manages (a buffer outside the blocks); the shards stay
        self.optimizer = adamw(_one_mesh_each(groups_of(model.hf)), opt, device)
        self.accumulation = accumulation
        self.clip = opt.grad_clip
        self.checkpoint_group = collectives.side_group()  # DCP's writes talk here, off the training thread
        self.staging = HostStaging(device.type == "cuda")  # DCP stages every checkpoint's shards into the same buffers
        self.rank = collectives.rank_env()[0]

    def __call__(self, **inputs):
        return self.module(**inputs)

    def backward(self, loss: torch.Tensor) -> None:
        (loss / self.accumulation).backward()  # each backward reduce-scatters into the sharded gradients

    def micro_step(self) -> None:
        """Nothing between accumulation boundaries: the sharded gradients accumulate."""

    def grad_norm(self) -> torch.Tensor:
        """The global norm, as one tensor on every rank: each mesh's gradients (the data-parallel shards, and with
        tensor parallelism the block projections' 2-D shards) combined by DTensor, then the meshes' norms."""
        by_mesh: dict[object, list[torch.Tensor]] = {}
        for p in self.module.parameters():
            if p.grad is not None:
                by_mesh.setdefault(getattr(p.grad, "device_mesh", None), []).append(p.grad)
        if not by_mesh:
            return torch.zeros(())
        norms = [torch.nn.utils.get_total_norm(grads) for grads in by_mesh.values()]
        norms = [n.full_tensor() if hasattr(n, "full_tensor") else n for n in norms]
        return torch.linalg.vector_norm(torch.stack(norms))

    def step(self, lr: float, norm: torch.Tensor) -> None:
        clipped_step(self.optimizer, self.module, lr, self.clip, norm)  # DTensor gradients, a plain norm

    def discard(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def snapshot(self, folder: Path, extra: dict[str, Any]) -> list[Write]:
        """Every rank's shards staged to host memory now and written by DCP's thread into `folder`/dcp; the
        returned write waits for them (on the trainer's writer thread) and names this rank's files."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_state, optimizer_state = get_state_dict(self.module, self.optimizer)
        shards = folder / SHARDS
        pending = dcp.async_save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=str(shards),
                                 process_group=self.checkpoint_group, async_stager=self.staging.stager)
        kept = to_host(extra) if self.rank == 0 else None
        rank = self.rank

        def write(out: Path) -> list[Path]:
            pending.result()
            files = sorted((out / SHARDS).glob(f"__{rank}_*.distcp"))
            if rank == 0:
                torch.save(kept, out / EXTRA)
                files += [out / SHARDS / ".metadata", out / EXTRA]
            return files

        return [write]

    def load(self, folder: Path, load_optimizer: bool = True) -> dict[str, Any]:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_model_state_dict, set_state_dict

        model_state, optimizer_state = get_state_dict(self.module, self.optimizer)
        state = {"model": model_state, **({"optimizer": optimizer_state} if load_optimizer else {})}
        dcp.load(state, checkpoint_id=str(folder / SHARDS))  # each rank reads the shards it holds now
        if load_optimizer:
            set_state_dict(self.module, self.optimizer, model_state_dict=state["model"],
                           optim_state_dict=state["optimizer"])
        else:
            set_model_state_dict(self.module, state["model"])
        return torch.load(folder / EXTRA, map_location="cpu", weights_only=False)

    def export_state_dict(self) -> dict[str, torch.Tensor]:
        """The whole model's weights on rank 0 (gathered from every rank's shards: every rank takes part); exports
        use write_hf_weights instead."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        state = get_model_state_dict(self.module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        return hf_state(state)


    def write_hf_weights(self, folder: Path) -> bool:
        """The export's weights written from the shards: every rank writes its own in safetensors through DCP's
        Hugging Face writer, which consolidates them into one file; no rank holds the whole model. A collective."""

        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint import HuggingFaceStorageWriter
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        state = hf_state(get_model_state_dict(self.module))
        if self.module.hf.config.tie_word_embeddings:
            state.pop("lm_head.weight", None)  # one tensor under two names: saved once, as save_pretrained does
        dcp.save(state, storage_writer=HuggingFaceStorageWriter(str(folder), save_distributed=True,
                                                                enable_consolidation=True))
        if self.rank == 0:  # the Hugging Face layout of one file
            (folder / "model-00001-of-00001.safetensors").rename(folder / WEIGHTS)
            (folder / "model.safetensors.index.json").unlink()
            shutil.rmtree(folder / "sharded")
        return True


def _meshes(device: str, world: int, shard_group: int | None, tensor_parallel: int):
    """(the whole device mesh, its data-parallel part FSDP2 shards over, the sharding in words). Ranks are laid out
    as the trainer reads data: tensor-parallel peers adjacent (rank = data-parallel rank x TP + TP rank)."""
    from torch.distributed.device_mesh import init_device_mesh

    data = world // tensor_parallel
    shard = min(shard_group or data, data)
    dims, names = ((data // shard, shard), ("replicate", "shard")) if shard < data else ((data,), ("shard",))
    if tensor_parallel > 1:
        dims, names = (*dims, tensor_parallel), (*names, "tp")
    mesh = init_device_mesh(device, dims, mesh_dim_names=names)
    data_mesh = mesh if tensor_parallel == 1 else mesh[names[0]] if len(names) == 2 else mesh[names[:-1]]
    words = f"FSDP2 over {data} ranks" if shard == data else f"HSDP: {data // shard} replicas x {shard} shards"
    return mesh, data_mesh, words + (f", tensor-parallel {tensor_parallel}" if tensor_parallel > 1 else "")


def _one_mesh_each(groups: list[dict]) -> list[dict]:
    """The parameter groups split by device mesh (with tensor parallelism, the block projections' 2-D mesh and the
    data-parallel mesh of the rest): AdamW's foreach kernels take one group's tensors at once, of one mesh."""
    split = []
    for group in groups:
        by_mesh: dict[object, list] = {}
        for p in group["params"]:
            by_mesh.setdefault(getattr(p, "device_mesh", None), []).append(p)
        split += [{**group, "params": params} for params in by_mesh.values()]
    return split


def _whole_digest(model: torch.nn.Module) -> int:
    """Of this rank's weights (its tensor-parallel slices where the model is split)."""
    from torch.distributed.tensor import DTensor

    return tensors_digest(v.to_local() if isinstance(v, DTensor) else v for v in model.state_dict().values())
