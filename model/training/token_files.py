"""The tokenized-source format: per split a shard set, `<split>/NNNNN.tokens` (uint16 or uint32 ids, each document
followed by EOS) with `<split>/NNNNN.offsets.npy` (int64 document starts in the shard, plus its end), and one
`meta.json`. Each shard is written by one task of the tokenize step (one curated shard each); the packer and the
evaluation memory-map them, and a document's global index runs through the shards in order."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from compass.infra.layout import TRAIN

META = "meta.json"
TOKENS_SUFFIX, OFFSETS_SUFFIX = ".tokens", ".offsets.npy"


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size <= 65535 else np.dtype(np.uint32)


def shard_paths(folder: Path, split: str, shard: int) -> tuple[Path, Path]:
    """The tokens and offsets files of one shard of a split."""
    stem = folder / split / f"{shard:05d}"
    return stem.with_suffix(TOKENS_SUFFIX), stem.with_suffix(OFFSETS_SUFFIX)


def write_split(folder: Path, split: str, documents: Iterable[list[int]], eos: int, dtype: np.dtype,
                shard: int = 0) -> tuple[int, int]:
    """Write one shard of a split from token-id lists (EOS appended to each), streamed: tokens and document ends
    go to disk in blocks of about FLUSH_TOKENS as they come, so memory does not grow with the shard; returns
    (documents, tokens)."""
    tokens_path, offsets_path = shard_paths(folder, split, shard)
    tokens_path.parent.mkdir(parents=True, exist_ok=True)
    ends = tokens_path.with_suffix(".ends.tmp")  # int64 document ends, raw; the .npy is written once counted
    pending: list[np.ndarray] = []
    pending_ends: list[int] = []
    total = documents_seen = flushed = 0
    with open(tokens_path, "wb") as out, open(ends, "wb") as out_ends:
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
    offsets = np.lib.format.open_memmap(offsets_path, mode="w+", dtype=np.int64,
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
    """Read-only, memory-mapped view of one tokenized split: its shards in order, one document index across them."""

    def __init__(self, folder: Path, split: str = TRAIN):
        meta = json.loads((folder / META).read_text())
        self.eos = meta["eos"]
        self.dtype = np.dtype(meta["dtype"])
        # listed by their offsets: node-local staging leaves out the token files of shards this node never reads
        offsets = sorted((folder / split).glob(f"*{OFFSETS_SUFFIX}"))
        self.shards = [p.with_name(p.name.removesuffix(OFFSETS_SUFFIX) + TOKENS_SUFFIX) for p in offsets]
        self._offsets = [np.load(p, mmap_mode="r") for p in offsets]
        self._tokens: list[np.ndarray | None] = [None] * len(self.shards)  # mapped when first read
        counts = [len(o) - 1 for o in self._offsets]
        self._first = np.concatenate([[0], np.cumsum(counts, dtype=np.int64)])  # first document of each shard

    @property
    def n_documents(self) -> int:
        return int(self._first[-1])

    @property
    def n_tokens(self) -> int:
        return sum(int(o[-1]) for o in self._offsets)

    def document(self, i: int) -> np.ndarray:
        shard = int(np.searchsorted(self._first, i, side="right")) - 1
        offsets, local = self._offsets[shard], i - int(self._first[shard])
        return self._shard(shard)[int(offsets[local]): int(offsets[local + 1])]

    @property
    def tokens(self) -> np.ndarray:
        """Every token of the split in one array, in memory: for held-out splits (a haystack, a loss sample)."""
        parts = [self._shard(i) for i in range(len(self.shards))]
        return np.concatenate(parts) if parts else np.zeros(0, self.dtype)

    def _shard(self, i: int) -> np.ndarray:
        mapped = self._tokens[i]
        if mapped is None:
            path = self.shards[i]
            if not path.exists():
                raise FileNotFoundError(f"{path}: this token shard is not in the folder (node-local staging copies "
                                        "only the shards of the rows this node's ranks read)")
            mapped = np.memmap(path, dtype=self.dtype, mode="r") if path.stat().st_size else np.zeros(0, self.dtype)
            self._tokens[i] = mapped
        return mapped
