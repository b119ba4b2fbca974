"""Tensor parallelism for the FSDP2 engine: the model's own tensor-parallel plan (transformers'
`config.base_model_tp_plan`, the same plan DeepSpeed's AutoTP reads) applied to every block with torch's DTensor
styles, Megatron's split: q/k/v and the MLP's gate/up column-wise (each rank computes its heads and its slice of
the MLP), o_proj and down_proj row-wise (one all-reduce after attention and one after the MLP). Embeddings, norms
between blocks and the head stay whole on every tensor-parallel rank (FSDP2 shards them over the data-parallel
ranks).

Qwen3's per-head q/k norms ("replicated_with_grad_allreduce" in the plan) see only this rank's heads: their weight
is a replicated DTensor and their input is marked as sharded on the heads dimension, so DTensor sums the weight's
gradient over the tensor-parallel ranks (each rank's heads contribute their part)."""

from __future__ import annotations

import torch

BLOCK = "layers.*."  # the plan's entries are per block: `layers.*.self_attn.q_proj`
HEADS_DIM = 2  # q/k before the norm: (batch, sequence, heads, head_dim)


class PlanNotSupported(ValueError):
    pass


def block_plan(config) -> dict[str, object]:
    """The torch styles of one block's modules, from the model's plan (module path inside the block -> style)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel,
              "replicated_with_grad_allreduce": lambda: SequenceParallel(sequence_dim=HEADS_DIM, use_local_output=True)}
    plan = {}
    for pattern, style in (config.base_model_tp_plan or {}).items():
        if not pattern.startswith(BLOCK) or style not in styles:
            raise PlanNotSupported(f"{type(config).__name__}'s tensor-parallel plan has {pattern}: {style}, which the "
                                   "FSDP2 engine does not apply (its styles: " + ", ".join(styles) + ")")
        plan[pattern.removeprefix(BLOCK)] = styles[style]()
    if not plan:
        raise PlanNotSupported(f"{type(config).__name__} has no tensor-parallel plan")
    return plan


def parallelize_blocks(hf: torch.nn.Module, mesh) -> None:
    """Every block's projections split over the 1-D tensor-parallel `mesh`, in place; the attention then runs on
    this rank's heads (num_heads and num_kv_heads are divided by the mesh's size, which the spec's check ensures)."""
    from torch.distributed.tensor.parallel import parallelize_module

    plan = block_plan(hf.config)
    for block in hf.model.layers:
        parallelize_module(block, mesh, plan)
