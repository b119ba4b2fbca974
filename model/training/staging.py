"""Node-local staging of the training data, done by the trainer itself so that it happens on every node.

SmolLM3's run lost throughput to a shared file system that evicted dataset shards until the data was moved to
local NVMe on every node. With `how.storage.local_cache`, the first rank of each node copies from the store (local
or S3) into that folder, each file checked against its manifest's sha256, before any rank reads; the node's other
ranks wait for the copies. A node copies only what its ranks read: every source's small files (metadata, each
shard's document offsets, the held-out split) first, then the training token shards that hold the documents of
its ranks' rows (model/training/packing.py: a row reads a contiguous block of documents), so a corpus far larger
than one node's disk is spread over the nodes. A complete copy whose sizes still match is reused, so a requeued
job or the next stage with the same rows starts at once.
"""

from __future__ import annotations

import io
import logging
import socket
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from compass.infra import resource_ledger
from compass.infra.layout import TRAIN
from compass.infra.manifest import MANIFEST
from compass.infra.store import Store
from compass.model.training.job import Staging
from compass.model.training.packing import row_documents
from compass.model.training.token_files import OFFSETS_SUFFIX, TOKENS_SUFFIX, counts_path, read_counts

log = logging.getLogger("compass.train")
NPY_HEADER_BYTES = 512  # numpy pads an .npy header to a multiple of 64 bytes; a 1-D array's fits in 128


def is_training_tokens(path: str) -> bool:
    return path.startswith(f"{TRAIN}/") and path.endswith(TOKENS_SUFFIX)


def stage_sources(staging: Staging, local_rank: int, rows: range, total_rows: int, workdir: Path | None = None,
                  timeout_s: float = 6 * 3600) -> dict[str, Path]:
    """The node-local copy of every source for the node's rows `rows` of `total_rows` (made here on local rank
    0, awaited on the others). What local rank 0 copied is left in `workdir`'s resource ledger parts, one per node
    (infra/resource_ledger.py), for the step's manifest."""
    ledger = resource_ledger.Ledger()
    with resource_ledger.counting(ledger):
        staged = _stage(staging, local_rank, rows, total_rows, timeout_s)
    if workdir is not None and local_rank == 0:
        ledger.write_part(workdir, f"staging-{socket.gethostname()}")
    return staged


def _stage(staging: Staging, local_rank: int, rows: range, total_rows: int, timeout_s: float) -> dict[str, Path]:
    store = Store(staging.store_root)
    staged: dict[str, Path] = {}
    for name, uri in staging.uris.items():
        start = time.perf_counter()
        documents = documents_per_shard(store, uri)
        needed = needed_shards(documents, rows, total_rows)
        staged[name] = _copied(store, uri, staging.cache, _all_but_other_shards(needed), local_rank, timeout_s)
        if local_rank == 0:
            log.info("staged %s at %s: %d of %d training shards, for rows %d-%d of %d (%.1fs)", name, staged[name],
                     len(needed), len(documents), rows.start, rows.stop - 1, total_rows, time.perf_counter() - start)
    return staged


def documents_per_shard(store: Store, uri: str) -> dict[str, int]:
    """{training token shard: its documents}, from the split's counts file (one small read), or, for a source
    tokenized without one, from the shape in each offsets file's header (a few hundred bytes read per shard); the
    copy then checks every file it takes in full."""
    manifest = store.read_manifest(uri)
    counted = counts_path(Path(), TRAIN).as_posix()
    if any(e.path == counted for e in manifest.files):
        documents, _ = read_counts(store.read_bytes(uri, counted).decode(), f"{uri}/{counted}")
        return {f"{TRAIN}/{i:05d}{TOKENS_SUFFIX}": n for i, n in enumerate(documents)}
    counts = {}
    for entry in store.entries(manifest, TRAIN):
        if entry.path.endswith(OFFSETS_SUFFIX):
            head = io.BytesIO(store.read_head(uri, entry.path, NPY_HEADER_BYTES))
            version = np.lib.format.read_magic(head)
            read_header = (np.lib.format.read_array_header_1_0 if version == (1, 0)
                           else np.lib.format.read_array_header_2_0)
            (ends,), _, _ = read_header(head)
            counts[entry.path.removesuffix(OFFSETS_SUFFIX) + TOKENS_SUFFIX] = ends - 1
    return dict(sorted(counts.items()))


def needed_shards(documents: dict[str, int], rows: range, total_rows: int) -> set[str]:
    """The training token shards (in document order, with their documents) holding the documents rows `rows` of
    `total_rows` read."""
    total = sum(documents.values())
    blocks = [b for b in (row_documents(total, r, total_rows) for r in rows) if len(b)]
    needed, first = set(), 0
    for shard, count in documents.items():
        if count and any(b.start < first + count and first < b.stop for b in blocks):
            needed.add(shard)
        first += count
    return needed


def _all_but_other_shards(shards: set[str]) -> Callable[[str], bool]:
    """Every file but the training token shards, and those of `shards`."""
    return lambda path: not is_training_tokens(path) or path in shards


def _copied(store: Store, uri: str, cache: Path, select: Callable[[str], bool], local_rank: int,
            timeout_s: float) -> Path:
    if local_rank == 0:
        return store.copy_verified(uri, cache, select=select)
    return _wait_for(store.staged_path(uri, cache, select=select), timeout_s)


def _wait_for(copy: Path, timeout_s: float) -> Path:
    deadline = time.monotonic() + timeout_s
    while not (copy / MANIFEST).exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"the node's first rank did not stage {copy} within {timeout_s:.0f} s")
        time.sleep(0.2)
    return copy
