"""The tokenize step's datatrove block (a module of its own: Slurm array tasks unpickle it, and the orchestrator
never imports datatrove or tokenizers for it)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from datatrove.data import DocumentsPipeline
from datatrove.pipeline.base import PipelineStep

BATCH = 256
BATCH_CHARS = 1 << 23  # 8M characters


class TokenShards(PipelineStep):
    """A rank's documents into one token shard of the split (token_files.write_split), in batches encoded by the
    tokenizer's threads without character offsets."""

    name = "tokens"
    type = "🔢 - TOKENIZE"

    def __init__(self, tokenizer_file: str, folder: str, split: str, eos: int, dtype: str):
        super().__init__()
        self.tokenizer_file, self.folder, self.split, self.eos, self.dtype = tokenizer_file, folder, split, eos, dtype

    def run(self, data: DocumentsPipeline, rank: int = 0, world_size: int = 1) -> DocumentsPipeline:
        import numpy as np
        from tokenizers import Tokenizer

        from compass.model.training.token_files import write_split

        tok = Tokenizer.from_file(self.tokenizer_file)

        def texts() -> Iterator[str]:
            for document in data:
                self.stat_update("documents")
                yield document.text

        _, tokens = write_split(Path(self.folder), self.split, _ids(tok, texts()), self.eos, np.dtype(self.dtype),
                                shard=rank)
        self.stat_update("tokens", value=tokens)
        return iter(())


def _batches(texts: Iterator[str]) -> Iterator[list[str]]:
    """Texts in batches of at most BATCH documents and about BATCH_CHARS characters: what is held at once."""
    batch: list[str] = []
    chars = 0
    for text in texts:
        batch.append(text)
        chars += len(text)
        if len(batch) == BATCH or chars >= BATCH_CHARS:
            yield batch
            batch, chars = [], 0
    if batch:
        yield batch


def _ids(tok, texts: Iterator[str]) -> Iterator[list[int]]:
    for batch in _batches(texts):  # encoded in parallel by the tokenizer's threads, without character offsets
        yield from (enc.ids for enc in tok.encode_batch_fast(batch))
