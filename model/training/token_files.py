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
    """Write one split from token-id lists (EOS appended to each); returns (documents, tokens)."""
    offsets = [0]
    with open(folder / f"{split}.tokens", "wb") as out:
        for ids in documents:
            row = np.asarray([*ids, eos], dtype=dtype)
            out.write(row.tobytes())
            offsets.append(offsets[-1] + len(row))
    np.save(folder / f"{split}.offsets.npy", np.asarray(offsets, dtype=np.int64))
    return len(offsets) - 1, offsets[-1]


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
