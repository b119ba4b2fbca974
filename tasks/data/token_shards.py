"""The tokenize step's datatrove block (a module of its own: Slurm array tasks unpickle it, and the orchestrator
never imports datatrove or tokenizers for it)."""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from contextlib import nullcontext
from pathlib import Path

from datatrove.data import DocumentsPipeline
from datatrove.pipeline.base import PipelineStep

from compass.infra.fingerprint import sha256_file
from compass.infra.manifest import FileEntry

BATCH = 256
BATCH_CHARS = 1 << 23  # 8M characters


class TokenShards(PipelineStep):
    """A rank's documents into one token shard of the split (token_files.write_split), in batches encoded by the
    tokenizer's threads without character offsets. `folder` may be a remote URL (s3://...): the shard is then
    written to this machine's temporary folder, hashed, uploaded and removed, so a rank holds one shard at most.
    `written_records`: where the rank records the path, size and sha256 of its files (tasks/data/written_files.py).
    """

    name = "tokens"
    type = "🔢 - TOKENIZE"

    def __init__(self, tokenizer_file: str, folder: str, split: str, eos: int, dtype: str,
                 written_records: str | None = None):
        super().__init__()
        self.tokenizer_file, self.folder, self.split, self.eos, self.dtype = tokenizer_file, folder, split, eos, dtype
        self.written_records = written_records

    def run(self, data: DocumentsPipeline, rank: int = 0, world_size: int = 1) -> DocumentsPipeline:
        import numpy as np
        from tokenizers import Tokenizer

        from compass.model.training.token_files import write_split

        tok = Tokenizer.from_file(self.tokenizer_file)

        def texts() -> Iterator[str]:
            for document in data:
                self.stat_update("documents")
                yield document.text

        remote = "://" in self.folder and not self.folder.startswith("file://")
        with tempfile.TemporaryDirectory(prefix="compass-tokens-") if remote else nullcontext(self.folder) as local:
            _, tokens = write_split(Path(local), self.split, _ids(tok, texts()), self.eos, np.dtype(self.dtype),
                                    shard=rank)
            if remote or self.written_records:
                written = _publish(Path(local), self.folder if remote else None, self.split, rank)
        self.stat_update("tokens", value=tokens)
        if self.written_records:
            from compass.tasks.data.written_files import record

            record(self.written_records, rank, written)
        return iter(())


def _publish(local: Path, remote: str | None, split: str, rank: int) -> list:
    """The shard's files hashed, and uploaded to `remote` when given; returns their FileEntry records."""
    from compass.model.training.token_files import shard_paths

    written = []
    for path in shard_paths(local, split, rank):
        relative = path.relative_to(local).as_posix()
        written.append(FileEntry(path=relative, size=path.stat().st_size, sha256=sha256_file(str(path))))
        if remote is not None:
            import fsspec

            fs, root = fsspec.core.url_to_fs(remote)
            fs.put_file(str(path), f"{root.rstrip('/')}/{relative}")
            path.unlink()
    return written


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
