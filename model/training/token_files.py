"""The tokenized-source format: per split, `<split>.tokens` (uint16 or uint32 ids, each document followed by EOS)
and `<split>.offsets.npy` (int64 document starts, plus the end), with `meta.json`. Written by the tokenize step,
memory-mapped by the packer and the evaluation."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from compass.infra.layout import TRAIN

META = "meta.json"


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size <= 65535 else np.dtype(np.uint32)


def write_split(folder: Path, split: str, documents: Iterable[list[int]], eos: int, dtype: np.dtype) -> tuple[int, int]:
    """Write one split from token-id lists (EOS appended to each), streamed: tokens and document ends go to disk
    in blocks of about FLUSH_TOKENS as they come, so memory does not grow with the split; returns (documents,
    tokens)."""
    ends = folder / f"{split}.ends.tmp"  # int64 document ends, raw; the .npy is written once their count is known
    pending: list[np.ndarray] = []
    pending_ends: list[int] = []
    total = documents_seen = flushed = 0
    with open(folder / f"{split}.tokens", "wb") as out, open(ends, "wb") as out_ends:
        for ids in documents:
            row = np.empty(len(ids) + 1, dtype=dtype)
            row[:-1], row[-1] = ids, eos
            pending.append(row)
            total += len(row)
            pending_ends.append(total)
            if len(pending_ends) >= FLUSH_DOCUMENTS or total - flushed >= FLUSH_TOKENS:
                _flush(out, out_ends, pending, pending_ends)
                documents_seen, flushed = documents_seen + len(pending_ends), total
                pending, pending_ends = [], []
        documents_seen += len(pending_ends)
        _flush(out, out_ends, pending, pending_ends)
    offsets = np.lib.format.open_memmap(folder / f"{split}.offsets.npy", mode="w+", dtype=np.int64,
                                        shape=(documents_seen + 1,))
    offsets[0] = 0
    if documents_seen:
        written = np.memmap(ends, dtype=np.int64, mode="r")
        for start in range(0, documents_seen, FLUSH_DOCUMENTS):  # copied a block at a time: pages come and go
            offsets[1 + start: 1 + start + FLUSH_DOCUMENTS] = written[start: start + FLUSH_DOCUMENTS]
        del written
    offsets.flush()
    del offsets
    ends.unlink()
    return documents_seen, total


FLUSH_TOKENS = 1 << 22  # ~4M tokens (8-16 MiB) held before a write
FLUSH_DOCUMENTS = 1 << 16


def _flush(out, out_ends, rows: list[np.ndarray], ends: list[int]) -> None:
    if rows:
        out.write(np.concatenate(rows).tobytes())
        out_ends.write(np.asarray(ends, dtype=np.int64).tobytes())


def write_meta(folder: Path, dtype: np.dtype, eos: int, vocab_size: int) -> None:
    (folder / META).write_text(json.dumps({"dtype": dtype.name, "eos": eos, "vocab_size": vocab_size}))


class TokenizedSource:
    """Read-only, memory-mapped view of one tokenized split."""

    def __init__(self, folder: Path, split: str = TRAIN):
        meta = json.loads((folder / META).read_text())
        self.eos = meta["eos"]
        path = folder / f"{split}.tokens"
        dtype = np.dtype(meta["dtype"])
        self.tokens = np.memmap(path, dtype=dtype, mode="r") if path.stat().st_size else np.zeros(0, dtype)
        self.offsets = np.load(folder / f"{split}.offsets.npy")

    @property
    def n_documents(self) -> int:
        return len(self.offsets) - 1

    def document(self, i: int) -> np.ndarray:
        return self.tokens[self.offsets[i]: self.offsets[i + 1]]
