"""Packed causal attention over the documents' cumulative lengths, from torch itself (the `varlen` backend).

A micro-batch of packed rows is one flattened sequence of documents, told apart by cumulative lengths
(model/training/packing.py `varlen_kwargs`, read on the host before the batch moved). On CUDA in bf16/fp16 the
documents go to torch's own variable-length Flash kernels (`torch.nn.attention.varlen.varlen_attn`: no flash-attn
wheel needed); elsewhere (CPU, fp32) to `compass::packed_causal_attention`, causal SDPA per document. Both are
single operators to torch.compile, with their shapes known without running them, so a compiled decoder layer keeps
its attention inside the graph (compass's per-document SDPA splits rows by data: a graph break in every layer).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from typing import Any

import torch
import torch.nn.functional as F

try:  # torch 2.9 and later; its keywords changed from release to release (TorchVarlen)
    from torch.nn.attention.varlen import varlen_attn
except ImportError:  # an older torch on the GPU nodes: said when the kernel is needed, not at import
    varlen_attn = None


@dataclass(frozen=True)
class TorchVarlen:
    """How the installed torch's `varlen_attn` takes causality, the softmax scale and grouped KV heads: torch 2.9
    had `is_causal` and neither a scale nor GQA; later releases added `scale`, replaced `is_causal` with
    `window_size` and added `enable_gqa`. Read once from its signature; what it lacks is done around it (the query
    pre-scaled, KV heads repeated), so every release computes the same attention."""

    causal: str  # "window_size" or "is_causal"
    scale: bool
    gqa: bool

    def call(self, kernel: Callable[..., torch.Tensor], query: torch.Tensor, key: torch.Tensor,
             value: torch.Tensor, cu_seqlens: torch.Tensor, max_length: int, scale: float) -> torch.Tensor:
        """Causal varlen attention of flattened [T, H, D] query and [T, KV, D] key/value."""
        kwargs: dict[str, Any] = {"window_size": (-1, 0)} if self.causal == "window_size" else {"is_causal": True}
        if self.scale:
            kwargs["scale"] = scale
        else:  # the kernel scales by D ** -0.5: the query carries the rest
            query = query * (scale * query.shape[-1] ** 0.5)
        if key.shape[1] != query.shape[1]:
            if self.gqa:
                kwargs["enable_gqa"] = True
            else:
                repeat = query.shape[1] // key.shape[1]
                key, value = key.repeat_interleave(repeat, dim=1), value.repeat_interleave(repeat, dim=1)
        return kernel(query, key, value, cu_seqlens, cu_seqlens, max_length, max_length, **kwargs)


def torch_varlen(kernel: Callable[..., Any] | None = None) -> TorchVarlen:
    """The installed torch's varlen signature (or `kernel`'s); ValueError naming torch's version where there is
    none or it cannot be causal."""
    return _signature_of(kernel if kernel is not None else varlen_attn)


@cache
def _signature_of(kernel: Callable[..., Any] | None) -> TorchVarlen:
    if kernel is None:
        raise ValueError(f"how.attention varlen needs torch.nn.attention.varlen.varlen_attn (torch 2.9 or later); "
                         f"this node's torch is {torch.__version__}: install the torch of the set-up's cluster "
                         "lock, or use attention: flash (flash-attn) or sdpa")
    names = inspect.signature(kernel).parameters
    causal = next((n for n in ("window_size", "is_causal") if n in names), None)
    if causal is None:
        raise ValueError(f"torch {torch.__version__}'s varlen_attn takes neither window_size nor is_causal: it "
                         "cannot attend causally; use attention: flash or sdpa")
    return TorchVarlen(causal, "scale" in names, "enable_gqa" in names)


def _per_document(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_seqlens: torch.Tensor,
                  scale: float) -> torch.Tensor:
    """Causal SDPA of each document alone: query [T, H, D], key/value [T, KV, D] (grouped when KV < H)."""
    bounds = cu_seqlens.tolist()
    gqa = key.shape[1] != query.shape[1]
    parts = [F.scaled_dot_product_attention(query[s:e].transpose(0, 1), key[s:e].transpose(0, 1),
                                            value[s:e].transpose(0, 1), is_causal=True, scale=scale,
                                            enable_gqa=gqa).transpose(0, 1)
             for s, e in zip(bounds[:-1], bounds[1:], strict=False) if e > s]
    return torch.cat(parts).contiguous()


@torch.library.custom_op("compass::packed_causal_attention", mutates_args=())
def packed_causal_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_seqlens: torch.Tensor,
                            scale: float) -> torch.Tensor:
    """Causal attention within each packed document ([T, H, D] out); the reference where varlen_attn cannot run."""
    return _per_document(query, key, value, cu_seqlens, scale)


@packed_causal_attention.register_fake
def _(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_seqlens: torch.Tensor,
      scale: float) -> torch.Tensor:
    return torch.empty_like(query)


def _document_grads(grad: torch.Tensor, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Causal attention's gradients for one document ([n, H, D] / [n, KV, D]), written out: an operator's body runs
    without autograd. A key/value head serves H/KV query heads in turn, as SDPA's grouped queries do."""
    heads, kv = query.shape[1], key.shape[1]
    q, k, v, d_out = (t.transpose(0, 1).float() for t in (query, key, value, grad))  # [heads, n, D]
    k, v = k.repeat_interleave(heads // kv, 0), v.repeat_interleave(heads // kv, 0)
    n = q.shape[1]
    future = torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1)
    p = torch.softmax((q @ k.transpose(1, 2) * scale).masked_fill(future, float("-inf")), dim=-1)
    d_v = p.transpose(1, 2) @ d_out
    d_p = d_out @ v.transpose(1, 2)
    d_s = p * (d_p - (d_p * p).sum(-1, keepdim=True)) * scale
    d_q, d_k = d_s @ k, d_s.transpose(1, 2) @ q
    d_k, d_v = (t.reshape(kv, heads // kv, n, -1).sum(1) for t in (d_k, d_v))
    return tuple(t.transpose(0, 1).to(ref.dtype) for t, ref in ((d_q, query), (d_k, key), (d_v, value)))


@torch.library.custom_op("compass::packed_causal_attention_backward", mutates_args=())
def packed_causal_attention_backward(grad: torch.Tensor, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                                     cu_seqlens: torch.Tensor, scale: float
                                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of the reference operator, a document at a time (one operator to compile too)."""
    bounds = cu_seqlens.tolist()
    grads = [_document_grads(grad[s:e], query[s:e], key[s:e], value[s:e], scale)
             for s, e in zip(bounds[:-1], bounds[1:], strict=False) if e > s]
    return tuple(torch.cat(parts).contiguous() for parts in zip(*grads, strict=True))


@packed_causal_attention_backward.register_fake
def _(grad: torch.Tensor, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_seqlens: torch.Tensor,
      scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return torch.empty_like(query), torch.empty_like(key), torch.empty_like(value)


def _setup_context(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
    query, key, value, cu_seqlens, scale = inputs
    ctx.save_for_backward(query, key, value, cu_seqlens)
    ctx.scale = scale


def _backward(ctx: Any, grad: torch.Tensor) -> tuple:
    query, key, value, cu_seqlens = ctx.saved_tensors
    dq, dk, dv = packed_causal_attention_backward(grad.contiguous(), query, key, value, cu_seqlens, ctx.scale)
    return dq, dk, dv, None, None


packed_causal_attention.register_autograd(_backward, setup_context=_setup_context)


def uses_torch_kernel(query: torch.Tensor) -> bool:
    """Whether torch's varlen Flash kernels take this query: CUDA, in bf16 or fp16."""
    return query.is_cuda and query.dtype in (torch.bfloat16, torch.float16)


def document_varlen(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                    cu_seq_lens_q: torch.Tensor | None = None, max_length_q: int | None = None,
                    **_: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention interface over packed documents: query [B, H, L, D], key/value [B, KV, L, D] and the
    cumulative lengths of every document of the flattened micro-batch; returns [B, L, H, D]."""
    if attention_mask is not None or cu_seq_lens_q is None or max_length_q is None:
        raise ValueError("the varlen backend takes documents from cumulative lengths (cu_seq_lens_q, max_length_q), "
                         "not an attention mask: the packer gives them (packing.varlen_kwargs)")
    if dropout:
        raise ValueError("the varlen backend has no attention dropout")
    batch, heads, length, dim = query.shape
    scale = scaling if scaling is not None else dim ** -0.5
    flat = [t.transpose(1, 2).reshape(batch * length, t.shape[1], dim) for t in (query, key, value)]
    if uses_torch_kernel(query):
        out = torch_varlen().call(varlen_attn, *flat, cu_seq_lens_q, max_length_q, scale)
    else:
        out = packed_causal_attention(*flat, cu_seq_lens_q, scale)
    return out.reshape(batch, length, heads, dim), None
