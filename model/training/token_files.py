"""The tokenized-source format: per split a shard set, `<split>/NNNNN.tokens` (uint16 or uint32 ids, each document
followed by EOS) with `<split>/NNNNN.offsets.npy` (int64 document starts in the shard, plus its end), and one
`meta.json`. Each shard is written by one task of the tokenize step (one curated shard each); the packer and the
evaluation memory-map them, and a document's global index runs through the shards in order.

The tokenize step also writes `<split>.counts.json`, the documents and tokens of every shard of the split, so a
reader knows the whole index from one small file: node-local staging picks its shards with one read of the store
(not a header read per shard), and a reader maps a shard's offsets only when it reads one of its documents (a
process may hold only so many memory maps: 65,530 by default on Linux)."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from compass.infra.errors import DamagedArtifact
from compass.infra.layout import TRAIN

META = "meta.json"
TOKENS_SUFFIX, OFFSETS_SUFFIX = ".tokens", ".offsets.npy"
COUNTS_SUFFIX = ".counts.json"


def counts_path(folder: Path, split: str) -> Path:
    return folder / f"{split}{COUNTS_SUFFIX}"


def split_parts(split: str) -> tuple[str, ...]:
    """What reading one split of a tokenized source takes of its artifact: its shards, their counts and the
    source's metadata (the other split never)."""
    return (META, split, f"{split}{COUNTS_SUFFIX}")


def write_counts(folder: Path, split: str, documents: list[int], tokens: list[int]) -> None:
    """The documents and tokens of shards 0..n-1 of a split (shard i is `<split>/<i:05d>`)."""
    counts_path(folder, split).write_text(json.dumps({"documents": documents, "tokens": tokens}))


def read_counts(text: str, where: str) -> tuple[list[int], list[int]]:
    """(documents, tokens) per shard from a counts file's text; DamagedArtifact when it does not hold them."""

    try:
        data = json.loads(text)
        documents, tokens = [int(n) for n in data["documents"]], [int(n) for n in data["tokens"]]
    except (ValueError, KeyError, TypeError) as exc:
        raise DamagedArtifact(f"{where}: not a token shard count file ({exc})") from None
    if len(documents) != len(tokens):
        raise DamagedArtifact(f"{where}: {len(documents)} document counts for {len(tokens)} token counts")
    return documents, tokens


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
        counted = counts_path(folder, split)
        if counted.exists():
            documents, tokens = read_counts(counted.read_text(), str(counted))
            stems = [folder / split / f"{i:05d}" for i in range(len(documents))]
        else:  # written without counts (a test's folder): from the offsets files' headers
            # listed by their offsets: node-local staging leaves out the token files of shards this node never reads
            stems = [p.with_name(p.name.removesuffix(OFFSETS_SUFFIX))
                     for p in sorted((folder / split).glob(f"*{OFFSETS_SUFFIX}"))]
            ends = [np.load(s.with_name(s.name + OFFSETS_SUFFIX), mmap_mode="r") for s in stems]
            documents, tokens = [len(e) - 1 for e in ends], [int(e[-1]) for e in ends]
        self.shards = [s.with_name(s.name + TOKENS_SUFFIX) for s in stems]
        self._counts = list(zip(documents, tokens, strict=True))
        self._offsets: list[np.ndarray | None] = [None] * len(stems)  # mapped when first read, as the tokens
        self._tokens: list[np.ndarray | None] = [None] * len(self.shards)
        self._first = np.concatenate([[0], np.cumsum(documents, dtype=np.int64)])  # first document of each shard
        self._n_tokens = sum(tokens)

    @property
    def n_documents(self) -> int:
        return int(self._first[-1])

    @property
    def n_tokens(self) -> int:
        return self._n_tokens

    @property
    def shard_counts(self) -> list[tuple[int, int]]:
        """(documents, tokens) of each shard, in order."""
        return list(self._counts)

    def first_document(self, shard: int) -> int:
        """The split's index of the shard's first document."""
        return int(self._first[shard])

    def shard_tokens(self, shard: int) -> np.ndarray:
        """One shard's tokens (mapped, not read)."""
        return self._shard(shard)

    def document(self, i: int) -> np.ndarray:
        shard = int(np.searchsorted(self._first, i, side="right")) - 1
        offsets, local = self._shard_offsets(shard), i - int(self._first[shard])
        return self._shard(shard)[int(offsets[local]): int(offsets[local + 1])]

    def _shard_offsets(self, i: int) -> np.ndarray:
        offsets = self._offsets[i]
        if offsets is None:
            path = self.shards[i].with_name(self.shards[i].name.removesuffix(TOKENS_SUFFIX) + OFFSETS_SUFFIX)
            offsets = np.load(path, mmap_mode="r")
            if (len(offsets) - 1, int(offsets[-1])) != self._counts[i]:

                raise DamagedArtifact(f"{path}: {len(offsets) - 1} documents and {int(offsets[-1])} tokens, its "
                                      f"split's counts say {self._counts[i][0]} and {self._counts[i][1]}")
            self._offsets[i] = offsets
        return offsets

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
