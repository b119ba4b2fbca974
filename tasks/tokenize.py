"""Tokenize one curated source with the chosen tokenizer into memory-mappable arrays.

Per split (train, heldout): `<split>.tokens` (uint16 or uint32, each document followed by EOS) and
`<split>.offsets.npy` (int64, document start offsets, plus the end).
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
from compass.tasks.base import StepContext, StepResult
from tokenizers import Tokenizer

BATCH = 256


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size <= 65535 else np.dtype(np.uint32)


def _texts(folder: Path) -> Iterator[str]:
    for shard in sorted(folder.glob("*.jsonl.gz")):
        with gzip.open(shard, "rt", encoding="utf-8") as f:
            for line in f:
                yield json.loads(line)["text"]


def run_tokenize(ctx: StepContext) -> StepResult:
    tok_dir = ctx.inputs["tokenizer"].local() / "chosen"
    tok = Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
    special = json.loads((tok_dir / "tokenizer_config.json").read_text())
    eos = tok.token_to_id(special["eos_token"])
    dtype = token_dtype(tok.get_vocab_size())
    curated = ctx.inputs["curated"].local()
    metrics: dict[str, int] = {}
    for split in ("train", "heldout"):
        offsets = [0]
        with open(ctx.out / f"{split}.tokens", "wb") as out:
            batch: list[str] = []
            for text in [*_texts(curated / split), None]:
                if text is not None:
                    batch.append(text)
                if batch and (text is None or len(batch) == BATCH):
                    for enc in tok.encode_batch(batch):
                        ids = np.asarray([*enc.ids, eos], dtype=dtype)
                        out.write(ids.tobytes())
                        offsets.append(offsets[-1] + len(ids))
                    batch = []
        np.save(ctx.out / f"{split}.offsets.npy", np.asarray(offsets, dtype=np.int64))
        metrics[f"{split}_documents"] = len(offsets) - 1
        metrics[f"{split}_tokens"] = offsets[-1]
    (ctx.out / "meta.json").write_text(json.dumps({"dtype": dtype.name, "eos": eos,
                                                   "vocab_size": tok.get_vocab_size()}))
    summary = (f"### tokenize `{ctx.name}`\n\n{metrics['train_tokens']:,} training tokens in "
               f"{metrics['train_documents']:,} documents; {metrics['heldout_tokens']:,} held-out tokens")
    return StepResult(metrics=metrics, summary=summary)


class TokenizedSource:
    """Read-only, memory-mapped view of one tokenized split."""

    def __init__(self, folder: Path, split: str = "train"):
        meta = json.loads((folder / "meta.json").read_text())
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
