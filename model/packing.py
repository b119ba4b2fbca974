"""Mixture sampling and sequence packing with intra-document masking.

The Packer draws documents source by source according to the stage's mixture weights, deterministically
from the seed, and packs them into fixed-length sequences. Its whole state (random generator, per-source
epoch and cursor, the partly consumed document) is small and goes into every checkpoint: resuming restores
it and continues with exactly the sequence an uninterrupted run would have produced.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from compass.model.token_files import TokenizedSource


@dataclass
class PackedBatch:
    input_ids: torch.Tensor     # [B, L]
    position_ids: torch.Tensor  # [B, L], restarting at every document start
    segment_ids: torch.Tensor   # [B, L], which document each token belongs to (per sequence)
    labels: torch.Tensor        # [B, L], -100 where the previous token belongs to another document

    def attention_mask(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """4D additive mask [B, 1, L, L]: causal and block-diagonal, so no token attends across documents."""
        same = self.segment_ids[:, :, None] == self.segment_ids[:, None, :]
        length = self.segment_ids.shape[1]
        causal = torch.ones(length, length, dtype=torch.bool).tril()
        allowed = same & causal
        mask = torch.zeros(allowed.shape, dtype=dtype)
        mask.masked_fill_(~allowed, torch.finfo(dtype).min)
        return mask[:, None]

    def model_inputs(self, masking: bool, device: torch.device) -> dict[str, Any]:
        """Keyword arguments for a transformers causal LM: position ids restart at every document, and with
        `masking` the block-diagonal mask keeps documents apart."""
        inputs: dict[str, Any] = {"input_ids": self.input_ids.to(device), "position_ids": self.position_ids.to(device),
                                  "use_cache": False}
        if masking:
            inputs["attention_mask"] = self.attention_mask().to(device)
        return inputs

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def slice(self, start: int, stop: int) -> PackedBatch:
        return PackedBatch(self.input_ids[start:stop], self.position_ids[start:stop], self.segment_ids[start:stop],
                           self.labels[start:stop])


PADDING = -1  # segment id of padding: its own block in the mask, never a label


class Packer:
    def __init__(self, sources: dict[str, TokenizedSource], weights: dict[str, float], seq_len: int, seed: int,
                 whole_from: int | None = None, pad_id: int = 0):
        """`whole_from`: documents longer than this (and no longer than `seq_len`) are never split across
        sequences; a long-context stage sets it to the previous context length, so the long documents it is
        meant to learn from arrive whole. The rest of a sequence they do not fit in is padding, masked out."""
        self.names = sorted(weights)
        missing = [n for n in self.names if sources[n].n_documents == 0]
        if missing:
            raise ValueError(f"mixture sources without training documents: {missing}")
        self.sources = [sources[n] for n in self.names]
        total = sum(weights.values())
        self.probs = np.asarray([weights[n] / total for n in self.names])
        self.seq_len = seq_len
        self.seed = seed
        self.whole_from = whole_from
        self.pad_id = pad_id
        self.rng = np.random.default_rng([seed, 0x5EED])
        self.epochs = [0] * len(self.names)
        self.cursors = [0] * len(self.names)
        self.carry: tuple[int, int, int] | None = None  # (source, document, tokens already used)
        self.sequences = 0
        self._orders: dict[tuple[int, int], np.ndarray] = {}

    # --- state -----------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"rng": self.rng.bit_generator.state, "epochs": list(self.epochs), "cursors": list(self.cursors),
                "carry": list(self.carry) if self.carry else None, "sequences": self.sequences,
                "names": self.names, "seed": self.seed, "seq_len": self.seq_len}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["names"] != self.names or state["seq_len"] != self.seq_len:
            raise ValueError("checkpoint's data state belongs to another mixture or sequence length")
        self.rng.bit_generator.state = state["rng"]
        self.epochs, self.cursors = list(state["epochs"]), list(state["cursors"])
        self.carry = tuple(state["carry"]) if state["carry"] else None
        self.sequences = state["sequences"]

    # --- sampling --------------------------------------------------------------------------------------
    def _order(self, source: int, epoch: int) -> np.ndarray:
        key = (source, epoch)
        if key not in self._orders:
            n = self.sources[source].n_documents
            self._orders = {k: v for k, v in self._orders.items() if k[0] != source}  # keep one epoch per source
            self._orders[key] = np.random.default_rng([self.seed, source, epoch]).permutation(n)
        return self._orders[key]

    def _next_document(self) -> tuple[int, int]:
        source = int(self.rng.choice(len(self.sources), p=self.probs))
        order = self._order(source, self.epochs[source])
        doc = int(order[self.cursors[source]])
        self.cursors[source] += 1
        if self.cursors[source] == len(order):
            self.epochs[source] += 1
            self.cursors[source] = 0
        return source, doc

    def next_sequence(self) -> tuple[np.ndarray, np.ndarray]:
        """(tokens, segment ids) of one packed sequence."""
        tokens = np.empty(self.seq_len, dtype=np.int64)
        segments = np.empty(self.seq_len, dtype=np.int64)
        filled, segment = 0, 0
        while filled < self.seq_len:
            if self.carry is None:
                source, doc = self._next_document()
                self.carry = (source, doc, 0)
            source, doc, used = self.carry
            piece = self.sources[source].document(doc)[used:]
            if (self.whole_from is not None and used == 0 and filled > 0
                    and self.whole_from < len(piece) <= self.seq_len and len(piece) > self.seq_len - filled):
                tokens[filled:] = self.pad_id  # the document starts the next sequence, whole
                segments[filled:] = PADDING
                break
            take = min(len(piece), self.seq_len - filled)
            tokens[filled: filled + take] = piece[:take]
            segments[filled: filled + take] = segment
            filled += take
            segment += 1
            self.carry = None if take == len(piece) else (source, doc, used + take)
        self.sequences += 1
        return tokens, segments

    def next_batch(self, n: int) -> PackedBatch:
        rows = [self.next_sequence() for _ in range(n)]
        return make_batch(np.stack([r[0] for r in rows]), np.stack([r[1] for r in rows]))


def make_batch(tokens: np.ndarray, segments: np.ndarray) -> PackedBatch:
    input_ids = torch.from_numpy(tokens)
    seg = torch.from_numpy(segments)
    starts = torch.ones_like(seg, dtype=torch.bool)
    starts[:, 1:] = seg[:, 1:] != seg[:, :-1]
    # position = index minus the index where the current segment started
    idx = torch.arange(seg.shape[1]).expand_as(seg)
    start_idx = torch.where(starts, idx, torch.zeros_like(idx)).cummax(dim=1).values
    positions = idx - start_idx
    labels = input_ids.clone()
    labels[starts] = -100  # the token before belongs to another document (or there is none)
    labels[seg == PADDING] = -100
    return PackedBatch(input_ids, positions, seg, labels)
