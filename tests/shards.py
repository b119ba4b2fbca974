"""Document shards as the tests read and write them: JSONL in zstd, as compass's ShardWriter writes them
(tasks/data/curate_blocks.py)."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import zstandard

from compass.infra.layout import SHARD_SUFFIX

__all__ = ["SHARD_SUFFIX", "compress", "decompress", "shard_lines", "shard_records", "write_shard"]


def decompress(data: bytes) -> bytes:
    return zstandard.ZstdDecompressor().stream_reader(io.BytesIO(data), read_across_frames=True).read()


def compress(data: bytes) -> bytes:
    return zstandard.ZstdCompressor(level=3).compress(data)


def shard_lines(path: Path) -> list[str]:
    return decompress(path.read_bytes()).decode("utf-8").splitlines()


def shard_records(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in shard_lines(path) if line.strip()]


def write_shard(path: Path, records: list[dict[str, Any]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(compress("".join(json.dumps(r) + "\n" for r in records).encode("utf-8")))
