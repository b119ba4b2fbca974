"""The checks every training run makes of its ranks before the first step: where each rank is (node, CPUs, device),
that replicas start from identical weights and tensor-parallel shards from different slices of one initialisation,
that the batch is shared or split as the parallelism says, and that the shards, gathered, equal what the stage
starts from. SmolLM3 lost a 1T-token run to tensor-parallel ranks seeded alike."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file

from compass.infra.layout import CheckpointFolder, ModelArtifact
from compass.model.training import collectives
from compass.model.training.engines import Engine, tensors_digest
from compass.model.training.job import TrainJob
from compass.model.training.packing import PackedBatch
from compass.model.training.rank_device import RankDevice
from compass.model.training.records import RankPlace


def rank_places(rank: int, world: int, place: RankDevice) -> list[RankPlace]:
    """Every rank's node, CPU affinity and device (gathered on every rank; rank 0 reports them)."""
    mine = RankPlace(rank=rank, node=place.node, cpus=sorted(os.sched_getaffinity(0)), device=place.describe(),
                     local_rank=place.local_rank, gpu=place.gpu,
                     visible=None if place.visible is None else list(place.visible))
    if world == 1:
        return [mine]
    return [RankPlace.model_validate(p) for p in collectives.all_gather_object(mine.model_dump())]

def ranks_agree(engine: Engine, local: PackedBatch, *, dp_rank: int, tp_rank: int, tp: int, rank: int,
                held: torch.dtype, reference: Callable[[], tuple[dict[str, int] | None, str]]) -> str:
    """Before the first step (a collective: every rank calls it): every rank's weights and batch against the
    others' (check_ranks) and, with tensor parallelism, the shards gathered against `reference()` (rank 0's: what
    the stage starts from)."""
    weights = getattr(engine, "initial_digest", None)  # FSDP2: of the whole model, before sharding
    weights = _digest(engine.module.state_dict().values()) if weights is None else weights
    mine = torch.tensor([dp_rank, tp_rank, weights, _digest([local.input_ids])], dtype=torch.int64)
    everyone = collectives.all_gather(mine)  # on the backend's device: NCCL moves CUDA tensors only
    summary = check_ranks([tuple(int(x) for x in t) for t in everyone])
    if tp > 1:
        gathered = engine.export_state_dict()  # collective: rank 0 receives the whole model
        expected, what = reference() if rank == 0 else ({}, "")
        compared = rank == 0 and expected is not None
        bad = torch.tensor([len(gathered_mismatch(expected, gathered, held)) if compared else 0])
        bad = collectives.broadcast(bad, 0)
        if int(bad):
            raise RuntimeError(f"{int(bad)} tensors' tensor-parallel shards, gathered, differ from {what}: the "
                               "model was not sharded from one set of weights")
        if rank == 0:
            summary += f"; shards gathered equal {what}" if compared else f"; shards gathered ({what})"
    return summary

def start_digests(resumed: Path | None, job: TrainJob, initial: dict[str, int],
                  held: torch.dtype) -> tuple[dict[str, int] | None, str]:
    """What the gathered shards must equal: the weights every rank built whole (`initial`), or the Hugging Face
    export of what the stage continues from (the checkpoint it resumed, or the previous stage's `final/`, which its
    artifact keeps beside the `state/` the job names)."""
    if resumed is not None:
        if not CheckpointFolder(resumed).exported:  # how.checkpoints.hf_export_every skipped this one
            return None, f"not compared: {resumed.name} holds no Hugging Face export"
        folder, what = CheckpointFolder(resumed).hf, f"the export of {resumed.name}"
    elif job.init_from is not None:
        folder, what = ModelArtifact(job.init_from.parent).final, "the previous stage's exported model"
    elif job.init_weights is not None:
        folder, what = job.init_weights, "the starting checkpoint"
    else:
        return initial, "the initial weights"
    state: dict[str, torch.Tensor] = {}
    for path in sorted(folder.glob("*.safetensors")):
        state |= load_file(str(path))
    if not state:
        raise RuntimeError(f"no safetensors under {folder} to check the tensor-parallel shards against")
    return state_digests(state, held), what


def _digest(tensors) -> int:
    return tensors_digest(tensors)


def state_digests(state: dict[str, torch.Tensor], dtype: torch.dtype | None = None) -> dict[str, int]:
    """Each tensor's digest as an engine holding its weights in `dtype` holds it (floating tensors cast)."""
    return {k: _digest([_held(v, dtype)]) for k, v in state.items()}


def _held(tensor: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    return tensor.to(dtype) if dtype is not None and tensor.is_floating_point() else tensor


def check_ranks(ranks: list[tuple[int, int, int, int]]) -> str:
    """From every rank's (data-parallel rank, tensor-parallel rank, weights digest, batch digest): replicas of one
    shard hold identical weights, the shards of a tensor differ (SmolLM3 lost a 1T-token run to tensor-parallel
    ranks seeded alike), tensor-parallel peers see the same batch and data-parallel ranks different ones."""
    by_shard: dict[int, set[int]] = {}
    by_replica: dict[int, set[int]] = {}
    for dp_rank, tp_rank, weights, data in ranks:
        by_shard.setdefault(tp_rank, set()).add(weights)
        by_replica.setdefault(dp_rank, set()).add(data)
    if any(len(w) > 1 for w in by_shard.values()):
        raise RuntimeError("data-parallel ranks start from different weights: check seeding and broadcasting")
    if len(by_shard) > 1 and len({next(iter(w)) for w in by_shard.values()}) != len(by_shard):
        raise RuntimeError("tensor-parallel ranks hold identical shards: their shards must be different slices of "
                           "one initialisation (SmolLM3 lost 1T tokens to tensor-parallel ranks seeded alike)")
    if any(len(d) > 1 for d in by_replica.values()):
        raise RuntimeError("tensor-parallel peers received different batches: they must share one")
    if len({next(iter(d)) for d in by_replica.values()}) != len(by_replica):
        raise RuntimeError("data-parallel ranks received identical batches: check the data sharding")
    dp, tp = len(by_replica), len(by_shard)
    return (f"{len(ranks)} ranks ({dp} data-parallel x {tp} tensor-parallel): identical replicas"
            + (", distinct data" if dp > 1 else "") + (", distinct shards" if tp > 1 else ""))


def gathered_mismatch(initial: dict[str, int], gathered: dict[str, torch.Tensor],
                      dtype: torch.dtype | None = None) -> list[str]:
    """The tensors whose tensor-parallel shards, gathered, differ from the single-process initialisation (both
    compared in `dtype`, the one the engine holds: `initial` digested by state_digests in it)."""
    return sorted(k for k, digest in initial.items()
                  if k not in gathered or _digest([_held(gathered[k], dtype)]) != digest)
