"""The language-modelling loss: next-token cross-entropy (labels are -100 across document boundaries and on
padding) plus the optional z-loss on the log-partition."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def lm_loss(logits: torch.Tensor, labels: torch.Tensor, z_loss: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss to optimise, cross-entropy alone)."""
    logits = logits[:, :-1].float()
    target = labels[:, 1:]
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1), ignore_index=-100)
    if z_loss > 0:
        valid = target != -100
        lse = torch.logsumexp(logits, dim=-1)[valid]
        return ce + z_loss * (lse**2).mean(), ce
    return ce, ce
