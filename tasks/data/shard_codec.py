"""Document shards' compression: JSONL in zstd, written reproducibly and read back by datatrove's readers (which
infer the codec from `.jsonl.zst`) and by compass's own (`open_shard`). Light: zstandard is imported when a shard
is opened, so the kinds can name the codec without loading it (`compass plan` imports every kind)."""

from __future__ import annotations

import io
from typing import IO, BinaryIO

import zstandard
from fsspec.compression import register_compression

SHARD_CODEC = "zstd-shards"
ZSTD_LEVEL = 3  # zstd's default: gzip -6's ratio at ~6x its speed (fsspec's own "zstd" writes at level 10)


def _zstd_shard(infile, mode: str = "rb", **kwargs):
    """A document shard's zstd stream. Writing: level 3, one thread, no content size or timestamp in the frame, so a
    shard recomputed by a relaunch, another executor or another machine is byte-identical (its digest in the
    manifest too). gzip -6 cost 2 of every 7 seconds of the tokenizer's own work per shard written
    (benchmarks/data_throughput.py); zstd a sixth of that."""

    if "r" in mode:  # as gzip.GzipFile(fileobj=...), closing the stream leaves the file to its opener
        return zstandard.ZstdDecompressor().stream_reader(infile, read_across_frames=True, closefd=False)
    return zstandard.ZstdCompressor(level=ZSTD_LEVEL).stream_writer(infile, closefd=False)


register_compression(SHARD_CODEC, _zstd_shard, [], force=True)  # here, wherever a shard is written


def open_shard(raw: BinaryIO, mode: str = "rt") -> IO:
    """A shard's JSONL lines from its compressed bytes (text, or bytes with mode "rb")."""
    stream = _zstd_shard(raw, "rb")
    return io.TextIOWrapper(stream, encoding="utf-8") if "t" in mode else stream
