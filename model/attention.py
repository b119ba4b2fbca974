"""Attention backends for packed rows, without a dense [L, L] mask.

Packed documents are told apart by position ids that restart at every document (no attention mask is passed),
and the backend keeps each document to itself:
- `flash`: flash-attention's variable-length kernels (`flash_attention_3` on Hopper when `flash_attn_interface` is
  installed, else `flash_attention_2`), fed the documents' cumulative lengths over the flattened micro-batch
  (transformers infers them from position ids for one row only); CUDA only;
- `varlen`: torch's own variable-length Flash kernels (`varlen_attn`, no external wheel) fed the same lengths, on
  CUDA in bf16/fp16; elsewhere a per-document reference operator (model/varlen.py). Either compiles as one
  operator: no graph break in a layer;
- `flex`: PyTorch's FlexAttention with the block mask transformers derives from the position ids; it has no
  backward on CPU in torch 2.13, so it trains on CUDA only;
- `sdpa`: compass's per-document SDPA, registered with transformers' AttentionInterface: each row is split at its
  document starts and every document runs causal `scaled_dot_product_attention` alone, so memory grows linearly
  with the row (PyTorch's flash or memory-efficient kernels; on CPU its flash kernel);
- `eager`: transformers' reference implementation with the mask it builds from the position ids (quadratic);
- `auto`: flash where it is installed, else varlen on CUDA, else compass's SDPA.
"""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    import torch

Backend = Literal["auto", "flash", "varlen", "flex", "sdpa", "eager"]
DOCUMENT_SDPA = "compass_document_sdpa"
DOCUMENT_VARLEN = "compass_varlen"


def document_starts(position_ids: torch.Tensor) -> list[list[int]]:
    """Per row, the offsets where a document starts (a position id that does not continue the previous one)."""
    import torch

    breaks = torch.ones_like(position_ids, dtype=torch.bool)
    breaks[:, 1:] = position_ids[:, 1:] != position_ids[:, :-1] + 1
    return [torch.nonzero(row).flatten().tolist() for row in breaks.cpu()]


_known: list[Any] = [None, None]  # (position ids, their starts): every layer of one forward gets the same tensor


def known_starts(position_ids: torch.Tensor, starts: list[list[int]]) -> None:
    """Tell the backend the document starts of a batch's position ids, read on the host before the batch moved
    to the device: the forward then needs no device-to-host sync to split the rows."""
    _known[:] = [position_ids, starts]


def _starts(position_ids: torch.Tensor, batch: int) -> list[list[int]]:
    """The document starts: as given by known_starts, else read once per forward (not once per layer)."""
    if _known[0] is not position_ids:
        _known[:] = [position_ids, document_starts(position_ids.expand(batch, -1))]
    return _known[1]


def document_sdpa(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                  position_ids: torch.Tensor | None = None, **_: Any) -> tuple[torch.Tensor, None]:
    """Causal attention within each document of each row. query [B, H, L, D], key/value [B, KV, L, D] (grouped
    query attention when KV < H); returns [B, L, H, D] like transformers' own backends."""
    import torch
    import torch.nn.functional as F

    if attention_mask is not None:
        raise ValueError(f"{DOCUMENT_SDPA} takes documents from position ids, not an attention mask")
    batch, heads, length, _ = query.shape
    gqa = key.shape[1] != heads
    starts = [[0]] * batch if position_ids is None else _starts(position_ids, batch)
    rows = []
    for b, row_starts in enumerate(starts):
        bounds = [*row_starts, length]
        parts = [F.scaled_dot_product_attention(query[b:b + 1, :, s:e], key[b:b + 1, :, s:e], value[b:b + 1, :, s:e],
                                                dropout_p=dropout, is_causal=True, scale=scaling, enable_gqa=gqa)
                 for s, e in zip(bounds[:-1], bounds[1:], strict=False)]
        rows.append(parts[0] if len(parts) == 1 else torch.cat(parts, dim=2))
    return torch.cat(rows, dim=0).transpose(1, 2).contiguous(), None


def register() -> None:
    """Make compass's per-document SDPA and varlen attention transformers attention implementations (idempotent)."""
    import torch
    from transformers import AttentionInterface

    from compass.model.varlen import document_varlen

    # the splits depend on the data: compiled graphs call it eagerly
    AttentionInterface.register(DOCUMENT_SDPA, torch.compiler.disable(document_sdpa))
    AttentionInterface.register(DOCUMENT_VARLEN, document_varlen)  # one operator: stays inside compiled graphs


def forward_kwargs(implementation: str, training: bool) -> dict[str, Any]:
    """What a backend needs on every forward besides the position ids. FlexAttention while training: its main
    kernel (`FORCE_USE_FLEX_ATTENTION`). For queries under 128 tokens, or lengths inductor cannot bound, it picks the
    decoding kernel, which has no backward: "NoValidChoicesError" on an H200 (torch 2.11) in the first GPU run."""
    if implementation == "flex_attention" and training:
        return {"kernel_options": {"FORCE_USE_FLEX_ATTENTION": True}}
    return {}


def takes_sequence_lengths(implementation: str) -> bool:
    """Whether a transformers attention implementation needs the documents' lengths passed in (flash's varlen
    kernels at a micro-batch above one row; see model/training/packing.py `varlen_kwargs`). transformers tells a
    flash implementation by its name the same way."""
    return "flash" in implementation or implementation == DOCUMENT_VARLEN


def flash_kernel() -> str | None:
    """The flash-attention implementation installed here, newest first (None: neither package)."""
    if importlib.util.find_spec("flash_attn_interface") is not None:
        return "flash_attention_3"
    if importlib.util.find_spec("flash_attn") is not None:
        return "flash_attention_2"
    return None


def unavailable(choice: Backend, cuda: bool, training: bool = True) -> str | None:
    """Why `choice` cannot run on this machine (None when it can)."""
    if choice == "flash":
        if not cuda:
            return "flash attention needs a CUDA GPU"
        if flash_kernel() is None:
            return "flash attention needs the flash-attn package (pip install 'compass-lifecycle[gpu]')"
    if choice == "flex" and training and not cuda:
        return "FlexAttention has no backward pass on CPU in this torch: it trains on CUDA only"
    return None


def implementation(choice: Backend, cuda: bool, dropout: bool = False) -> str:
    """The transformers `attn_implementation` for a backend choice on this device; `dropout`: the model has
    attention dropout, which torch's varlen kernels do not (`auto` then takes per-document SDPA)."""
    problem = unavailable(choice, cuda, training=False)
    if problem:
        raise ValueError(problem)
    if choice == "flash" or (choice == "auto" and cuda and flash_kernel()):
        return flash_kernel() or "flash_attention_2"
    if choice == "varlen" or (choice == "auto" and cuda and not dropout):
        return DOCUMENT_VARLEN
    return {"flex": "flex_attention", "eager": "eager"}.get(choice, DOCUMENT_SDPA)
