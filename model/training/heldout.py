"""Held-out loss per source: the validation number every training stage reports and every evaluation repeats
on each checkpoint, computed the same way in both places (packed like training, chunked loss) on the same sample of
the split (model/training/heldout_sample.py: bounded, whatever the corpus's size)."""

from __future__ import annotations

from pathlib import Path

import torch

from compass.infra.layout import HELDOUT
from compass.model.attention import takes_sequence_lengths
from compass.model.lm import CausalLMWithLoss
from compass.model.training.heldout_sample import HeldoutSample
from compass.model.training.packing import Packer
from compass.model.training.token_files import TokenizedSource


@torch.no_grad()
def heldout_losses(model: torch.nn.Module, sources: dict[str, Path], seq_len: int, masking: bool,
                   device: torch.device, max_sequences: int = 16) -> dict[str, float]:
    """Mean next-token loss per source on its held-out sample, packed without mixing sources. `model` is a Hugging
    Face causal LM, or the CausalLMWithLoss that trains it."""
    scorer = model if isinstance(model, CausalLMWithLoss) else CausalLMWithLoss(model)
    lengths = takes_sequence_lengths(scorer.config._attn_implementation or "")
    was_training = scorer.training
    scorer.eval()
    out: dict[str, float] = {}
    for name, path in sorted(sources.items()):
        held = HeldoutSample(TokenizedSource(path, HELDOUT))
        if held.n_documents == 0:
            continue
        packer = Packer({name: held}, {name: 1.0}, seq_len, seed=0)
        n = min(max_sequences, max(1, held.n_tokens // seq_len))
        losses = [float(scorer(**packer.next_batch(1, masking).inputs(device, lengths))[1]) for _ in range(n)]
        out[name] = sum(losses) / len(losses)
    scorer.train(was_training)
    return out
