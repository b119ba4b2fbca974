"""The language-modelling loss: next-token cross-entropy (labels are -100 across document boundaries and on
padding) plus the optional z-loss on the log-partition, without ever holding fp32 logits for the whole batch.

- `chunked`: the hidden states go through the output head a chunk of tokens at a time; each chunk's logits are
  upcast, scored, turned into their gradient (softmax minus the one-hot target) and freed, so the peak is one
  chunk's logits (chunk x vocabulary), not batch x length x vocabulary, and nothing is recomputed;
- `liger`: Liger's fused linear cross-entropy (CUDA, `liger-kernel` installed), which never writes logits out;
- `lm_loss`: the reference on full logits, kept for tests and benchmarks.
"""

from __future__ import annotations

import importlib.util
from typing import Literal

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from compass.specs.costs import loss_chunk_tokens

LossKind = Literal["auto", "chunked", "liger"]


def lm_loss(logits: torch.Tensor, labels: torch.Tensor, z_loss: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference: (loss to optimise, cross-entropy alone) from full logits [B, L, V]."""
    logits = logits[:, :-1].float()
    target = labels[:, 1:]
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1), ignore_index=-100)
    if z_loss > 0:
        valid = target != -100
        lse = torch.logsumexp(logits, dim=-1)[valid]
        return ce + z_loss * (lse**2).mean(), ce
    return ce, ce


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    """Cross-entropy (and z-loss) of `hidden @ weight.T` a chunk of tokens at a time. The forward pass also
    computes the gradients for hidden and weight chunk by chunk (softmax minus the one-hot target), so neither the
    logits nor the softmax of the whole batch ever exist and nothing is recomputed in the backward pass."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, z_loss: float,
                chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
        needs_grad = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]
        device = hidden.device.type
        # under autocast (bf16 on CUDA) the matmuls run in its dtype; the softmax and sums in fp32
        compute = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else weight.dtype
        valid_all = target != -100
        count = valid_all.sum()
        ce_sum = torch.zeros((), dtype=torch.float32, device=hidden.device)
        z_sum = torch.zeros((), dtype=torch.float32, device=hidden.device)
        grad_hidden = torch.zeros_like(hidden) if needs_grad else None
        grad_weight = torch.zeros_like(weight) if needs_grad else None
        with torch.autocast(device, enabled=False):
            w = weight.to(compute)
            for start in range(0, hidden.shape[0], chunk):
                stop = start + chunk
                h, t, valid = hidden[start:stop].to(compute), target[start:stop], valid_all[start:stop]
                logits = (h @ w.T).float()  # the chunk's one vocabulary-sized buffer, reused in place below
                picked = logits.gather(1, t.clamp(min=0)[:, None])[:, 0]
                top = logits.max(dim=-1).values
                exp = logits.sub_(top[:, None]).exp_()
                total = exp.sum(dim=-1)
                lse = top + total.log()
                ce_sum += ((lse - picked) * valid).sum()
                if z_loss > 0:
                    z_sum += (lse.pow(2) * valid).sum()
                if needs_grad:  # d/dlogits of ce + z * lse^2 is softmax * (1 + 2 z lse) - onehot
                    grad = exp.div_(total[:, None])
                    if z_loss > 0:
                        grad.mul_(1 + 2 * z_loss * lse[:, None])
                    grad[torch.arange(len(t), device=t.device), t.clamp(min=0)] -= 1
                    grad = grad.mul_(valid[:, None]).div_(count.clamp(min=1)).to(compute)
                    grad_hidden[start:stop] = grad @ w
                    grad_weight += (grad.T @ h).to(grad_weight.dtype)
        ce = ce_sum / count
        loss = ce + z_loss * z_sum / count if z_loss > 0 else ce.clone()
        ctx.mark_non_differentiable(ce)
        ctx.save_for_backward(grad_hidden, grad_weight)
        return loss, ce

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor, _: torch.Tensor):
        grad_hidden, grad_weight = ctx.saved_tensors
        return (grad_hidden * grad_loss.to(grad_hidden.dtype) if ctx.needs_input_grad[0] else None,
                grad_weight * grad_loss.to(grad_weight.dtype) if ctx.needs_input_grad[1] else None, None, None, None)


def shifted(hidden: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Hidden states [B*L, d] (a view, no copy) and the token each one predicts [B*L] (-100: none): the labels
    shift left, not the hidden states."""
    target = torch.nn.functional.pad(labels[:, 1:], (0, 1), value=-100)
    return hidden.reshape(-1, hidden.shape[-1]), target.reshape(-1)


def chunked_lm_loss(hidden: torch.Tensor, labels: torch.Tensor, head: torch.nn.Module, z_loss: float,
                    chunk_tokens: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss, cross-entropy) from the last hidden states [B, L, d] and the output head (a bias-free linear
    layer), equal to `lm_loss` on the head's full logits."""
    h, target = shifted(hidden, labels)
    chunk = chunk_tokens or loss_chunk_tokens(head.weight.shape[0])
    return _ChunkedLinearCrossEntropy.apply(h, head.weight, target, z_loss, chunk)


def _chunk_sums(hidden: torch.Tensor, target: torch.Tensor, head: torch.nn.Module,
                with_z: bool) -> tuple[torch.Tensor, torch.Tensor]:
    logits = head(hidden).float()
    ce = F.cross_entropy(logits, target, reduction="sum", ignore_index=-100)
    z = (torch.logsumexp(logits, dim=-1).pow(2) * (target != -100)).sum() if with_z else logits.new_zeros(())
    return ce, z


def recomputed_lm_loss(hidden: torch.Tensor, labels: torch.Tensor, head: torch.nn.Module, z_loss: float,
                       chunk_tokens: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunked loss through the head module itself (each chunk recomputed in the backward pass): for ZeRO-3,
    where the head's weight is only whole inside the module's own forward."""
    h, target = shifted(hidden, labels)
    chunk_tokens = chunk_tokens or loss_chunk_tokens(head.weight.shape[0])
    n = (target != -100).sum()
    ce_sum = z_sum = hidden.new_zeros((), dtype=torch.float32)
    for start in range(0, target.numel(), chunk_tokens):
        ce, z = checkpoint(_chunk_sums, h[start:start + chunk_tokens], target[start:start + chunk_tokens], head,
                           z_loss > 0, use_reentrant=False)
        ce_sum, z_sum = ce_sum + ce, z_sum + z
    ce = ce_sum / n
    return (ce + z_loss * z_sum / n, ce) if z_loss > 0 else (ce, ce)


def liger_available() -> bool:
    return torch.cuda.is_available() and importlib.util.find_spec("liger_kernel") is not None


@torch.compiler.disable
def liger_lm_loss(hidden: torch.Tensor, labels: torch.Tensor, head: torch.nn.Linear,
                  z_loss: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Liger's fused linear cross-entropy (with its z-loss term), on CUDA. Left out of torch.compile's graph: its
    Triton kernels are already fused, and dynamo fails tracing its `addmm(..., out_dtype=)` (seen on an H200 with
    torch 2.11 and liger-kernel 0.8.5)."""
    from liger_kernel.transformers.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyLoss

    h, target = shifted(hidden, labels)
    fused = LigerFusedLinearCrossEntropyLoss(lse_square_scale=z_loss, return_z_loss=True)
    out = fused(head.weight, h, target, head.bias)
    loss, z = (out.loss, out.z_loss) if hasattr(out, "loss") else out  # liger >= 0.7 returns CrossEntropyOutput
    return loss, loss - z_loss * z if z_loss > 0 else loss


def resolve(kind: LossKind) -> Literal["chunked", "liger"]:
    if kind == "liger" and not liger_available():
        raise ValueError("the liger loss needs CUDA and the liger-kernel package (pip install "
                         "'compass-lifecycle[gpu]')")
    return "liger" if kind == "liger" or (kind == "auto" and liger_available()) else "chunked"
