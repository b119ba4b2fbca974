"""Held-out loss per source: the validation number every training stage reports and every evaluation repeats
on each checkpoint, computed the same way in both places."""

from __future__ import annotations

from pathlib import Path

import torch

from compass.model.loss import lm_loss
from compass.model.packing import Packer
from compass.model.token_files import TokenizedSource


@torch.no_grad()
def heldout_losses(model: torch.nn.Module, sources: dict[str, Path], seq_len: int, masking: bool,
                   device: torch.device, max_sequences: int = 16) -> dict[str, float]:
    """Mean next-token loss per source on its held-out documents, packed without mixing sources."""
    was_training = model.training
    model.eval()
    out: dict[str, float] = {}
    for name, path in sorted(sources.items()):
        held = TokenizedSource(path, "heldout")
        if held.n_documents == 0:
            continue
        packer = Packer({name: held}, {name: 1.0}, seq_len, seed=0)
        n = min(max_sequences, max(1, len(held.tokens) // seq_len))
        losses = []
        for _ in range(n):
            batch = packer.next_batch(1)
            logits = model(**batch.model_inputs(masking, device)).logits
            losses.append(float(lm_loss(logits, batch.labels.to(device), 0.0)[1]))
        out[name] = sum(losses) / len(losses)
    model.train(was_training)
    return out
