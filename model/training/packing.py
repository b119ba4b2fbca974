"""Mixture sampling and sequence packing, one independent stream per row of the global batch.

Row r of every global batch comes from its own stream: a Packer over block r of every source (the r-th
contiguous part of its document index, read in a fresh shuffled order each epoch), with its own random
generator. So a data-parallel rank packs only
its own rows, deterministically, and the union of all ranks' rows is exactly the batch one process would pack.
A stream's state (generator, per-source epoch and cursor, the partly consumed document) is small and does not
grow with the step: it goes into every checkpoint, and resuming continues with exactly the sequences an
uninterrupted run would have produced, at the same cost per batch at step 10 or step 100,000.

Batches are packed ahead on a background thread (Prefetcher, a bounded queue); the time a step waits for its
batch is measured.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

from compass.model.attention import document_starts, known_starts
from compass.model.training.windows import Window


class Documents(Protocol):
    n_documents: int

    def document(self, i: int) -> np.ndarray: ...


@dataclass
class PackedBatch:
    input_ids: torch.Tensor     # [B, L]
    position_ids: torch.Tensor  # [B, L]: restarting at every document start (with intra-document masking)
    segment_ids: torch.Tensor   # [B, L], which document each token belongs to (per sequence)
    labels: torch.Tensor        # [B, L], -100 where the previous token belongs to another document

    def dense_mask(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The 4D additive mask [B, 1, L, L] that keeps documents apart, for comparisons: training passes no mask
        (the attention backends split documents by position ids, in memory linear in L)."""
        same = self.segment_ids[:, :, None] == self.segment_ids[:, None, :]
        length = self.segment_ids.shape[1]
        causal = torch.ones(length, length, dtype=torch.bool).tril()
        allowed = same & causal
        mask = torch.zeros(allowed.shape, dtype=dtype)
        mask.masked_fill_(~allowed, torch.finfo(dtype).min)
        return mask[:, None]

    def inputs(self, device: torch.device, sequence_lengths: bool = False) -> dict[str, Any]:
        """Keyword arguments of CausalLMWithLoss: token ids, position ids, labels and, with `sequence_lengths`, the
        documents as flash-attention's varlen kernels take them (see `varlen_kwargs`). The document starts are read
        here, on the host, so that splitting rows into documents never waits on the device."""

        positions = self.position_ids.to(device, non_blocking=True)
        starts = document_starts(self.position_ids)
        known_starts(positions, starts)
        inputs: dict[str, Any] = {"input_ids": self.input_ids.to(device, non_blocking=True),
                                  "position_ids": positions, "labels": self.labels.to(device, non_blocking=True)}
        if sequence_lengths:
            inputs.update(varlen_kwargs(starts, self.position_ids.shape[1], device))
        return inputs

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def slice(self, start: int, stop: int) -> PackedBatch:
        return PackedBatch(self.input_ids[start:stop], self.position_ids[start:stop], self.segment_ids[start:stop],
                           self.labels[start:stop])


def varlen_kwargs(starts: list[list[int]], length: int, device: torch.device) -> dict[str, Any]:
    """Every document of a [B, L] batch as one flattened sequence of B*L tokens: cumulative lengths (int32) and the
    longest document, under the names transformers' flash path takes (`cu_seq_lens_q/k`, `max_length_q/k`).
    Without them transformers infers documents from position ids only for a batch of one row: at micro-batch 3
    flash would attend across every document of a row."""
    offsets = [row * length + s for row, row_starts in enumerate(starts) for s in row_starts] + [len(starts) * length]
    cu = torch.tensor(offsets, dtype=torch.int32)
    longest = int(cu.diff().max())
    cu = cu.to(device, non_blocking=True)
    return {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": longest, "max_length_k": longest}


PADDING = -1  # segment id of padding: its own block in the mask, never a label


def row_documents(total: int, row: int, rows: int) -> range:
    """The documents row `row` of `rows` reads from a source of `total`: a contiguous block of its document index,
    so that a row, and a node's rows, read only the token shards holding that block (node-local staging copies
    only those: model/training/staging.py). A source with fewer documents than rows gives every row one document
    (row r modulo its size): tiny sources repeat sooner, nothing else changes."""
    if total >= rows:
        return range(row * total // rows, (row + 1) * total // rows)
    return range(row % total, row % total + 1) if total else range(0)


def rank_rows(dp_rank: int, dp: int, rows: int) -> range:
    """The rows of every global batch of `rows` that data-parallel rank `dp_rank` of `dp` packs (its tensor-parallel
    peers pack the same)."""
    return range(dp_rank * rows // dp, (dp_rank + 1) * rows // dp)


def node_rows(rank: int, local_rank: int, local_world: int, world: int, tp: int, rows: int) -> range:
    """The rows a node's ranks pack: ranks are numbered node by node, `local_world` to a node (torchrun's
    LOCAL_WORLD_SIZE), tensor-parallel groups inside a node."""
    first = rank - local_rank
    last = min(first + local_world, world) - 1
    return range(rank_rows(first // tp, world // tp, rows).start, rank_rows(last // tp, world // tp, rows).stop)


class RowBlock:
    """Row `row`'s block of the stage's window of a source's documents (row_documents over the window; the whole
    source without one: model/training/windows.py), indexed from 0."""

    def __init__(self, source: Documents, row: int, rows: int, window: Window | None = None):
        self.source = source
        self.window = window if window is not None else Window(0, source.n_documents)
        block = row_documents(self.window.documents, row, rows)
        self.first, self.n_documents = block.start, len(block)

    def document(self, i: int) -> np.ndarray:
        return self.source.document(self.window.index(self.first + i, self.source.n_documents))


class Packer:
    """One stream: documents drawn source by source by the mixture weights, packed into sequences."""

    def __init__(self, sources: dict[str, Documents], weights: dict[str, float], seq_len: int, seed: int,
                 whole_from: int | None = None, pad_id: int = 0, stream: int = 0):
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
        self.stream = stream
        self.whole_from = whole_from
        self.pad_id = pad_id
        self.rng = np.random.default_rng([seed, 0x5EED, stream])
        self.epochs = [0] * len(self.names)
        self.cursors = [0] * len(self.names)
        self.carry: tuple[int, int, int] | None = None  # (source, document, tokens already used)
        self.sequences = 0
        self._orders: dict[tuple[int, int], np.ndarray] = {}

    # --- state -----------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"rng": self.rng.bit_generator.state, "epochs": list(self.epochs), "cursors": list(self.cursors),
                "carry": list(self.carry) if self.carry else None, "sequences": self.sequences,
                "names": self.names, "seed": self.seed, "seq_len": self.seq_len, "stream": self.stream}

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
            self._orders[key] = np.random.default_rng([self.seed, source, epoch, self.stream]).permutation(n)
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

    def next_batch(self, n: int, masking: bool = True) -> PackedBatch:
        rows = [self.next_sequence() for _ in range(n)]
        return make_batch(np.stack([r[0] for r in rows]), np.stack([r[1] for r in rows]), masking)


class RowPacker:
    """The rows `owned` of every global batch of `rows` rows, each from its own stream (see the module doc)."""

    def __init__(self, sources: dict[str, Documents], weights: dict[str, float], seq_len: int, seed: int,
                 rows: int, owned: range | None = None, whole_from: int | None = None, pad_id: int = 0,
                 masking: bool = True, windows: Mapping[str, Window] | None = None):
        """`windows`: the documents of each source the stage reads (model/training/windows.py; default whole)."""
        self.rows, self.masking = rows, masking
        self.owned = owned if owned is not None else range(rows)
        names = sorted(weights)
        windows = windows or {}
        self.streams = {r: Packer({n: RowBlock(sources[n], r, rows, windows.get(n)) for n in names}, weights,
                                  seq_len, seed, whole_from, pad_id, stream=r) for r in self.owned}

    def next_batch(self) -> PackedBatch:
        sequences = [self.streams[r].next_sequence() for r in self.owned]
        return make_batch(np.stack([s[0] for s in sequences]), np.stack([s[1] for s in sequences]), self.masking)

    def state_dict(self) -> dict[str, Any]:
        """Every owned stream's state by row (a checkpoint merges the states of all ranks)."""
        return {"rows": self.rows, "streams": {str(r): s.state_dict() for r, s in self.streams.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("rows") != self.rows:
            raise ValueError("checkpoint's data state was packed for another global batch size")
        for r, stream in self.streams.items():
            stream.load_state_dict(state["streams"][str(r)])


def merge_states(states: list[dict[str, Any]]) -> dict[str, Any]:
    """One data state from the states of every rank (each holds its own rows)."""
    return {"rows": states[0]["rows"], "streams": {k: v for s in states for k, v in s["streams"].items()}}


class Prefetcher:
    """Packs batches ahead on a thread, `depth` at most: each comes with the data state right after it, which a
    checkpoint taken after that batch must hold (batches still in the queue are not consumed yet)."""

    def __init__(self, packer: RowPacker, depth: int = 2):
        self.packer = packer
        self.queue: queue.Queue = queue.Queue(maxsize=depth)
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._fill, name="compass-prefetch", daemon=True)
        self.thread.start()

    def _fill(self) -> None:
        try:
            while not self.stopping.is_set():
                item = (self.packer.next_batch(), self.packer.state_dict())
                while not self.stopping.is_set():
                    try:
                        self.queue.put(item, timeout=0.1)
                        break
                    except queue.Full:
                        continue
        except BaseException as exc:  # raised in the training thread by next()
            self.queue.put((exc, None))

    def next(self) -> tuple[PackedBatch, dict[str, Any], float]:
        """(batch, data state after it, seconds waited for it)."""
        start = time.perf_counter()
        batch, state = self.queue.get()
        if isinstance(batch, BaseException):
            raise batch
        return batch, state, time.perf_counter() - start

    def close(self) -> None:
        self.stopping.set()
        self.thread.join()


def make_batch(tokens: np.ndarray, segments: np.ndarray, masking: bool = True) -> PackedBatch:
    """Position ids restart at every document (so attention keeps documents apart) unless `masking` is off;
    the first token of a document and padding are never labels."""
    input_ids = torch.from_numpy(tokens)
    seg = torch.from_numpy(segments)
    starts = torch.ones_like(seg, dtype=torch.bool)
    starts[:, 1:] = seg[:, 1:] != seg[:, :-1]
    idx = torch.arange(seg.shape[1]).expand_as(seg)
    if masking:  # position = index minus the index where the current segment started
        start_idx = torch.where(starts, idx, torch.zeros_like(idx)).cummax(dim=1).values
        positions = idx - start_idx
    else:
        positions = idx.clone()
    labels = input_ids.clone()
    labels[starts] = -100  # the token before belongs to another document (or there is none)
    labels[seg == PADDING] = -100
    return PackedBatch(input_ids, positions, seg, labels)
