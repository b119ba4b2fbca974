"""Node-local staging of the training data, done by the trainer itself so that it happens on every node.

SmolLM3's run lost throughput to a shared file system that evicted dataset shards until the data was moved to
local NVMe on every node. With `how.storage.local_cache`, the first rank of each node copies from the store (local
or S3) into that folder, each file checked against its manifest's sha256, before any rank reads; the node's other
ranks wait for the copies. A node copies only what its ranks read: every source's small files (metadata, the
shards' document offsets) and the held-out sample its validation scores (model/training/heldout_sample.py) first,
then the training token shards that hold the documents of its ranks' rows (model/training/packing.py: a row reads a
contiguous block of documents), so a corpus far larger than one node's disk is spread over the nodes; and only the
documents the stage reads (its windows, model/training/windows.py): a short ablation of a large corpus copies what
it trains on, not the corpus. With a counts file, only the read shards' offsets are copied too. A complete copy
whose sizes still match is reused, so a requeued job or the next stage with the same rows starts at once.
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
from compass.infra.layout import HELDOUT, TRAIN
from compass.infra.manifest import MANIFEST
from compass.infra.store import Store
from compass.model.training.heldout_sample import sample_files, sampled_shards
from compass.model.training.job import StageRecipe, Staging
from compass.model.training.node_scratch import make_room
from compass.model.training.packing import row_documents
from compass.model.training.token_files import OFFSETS_SUFFIX, TOKENS_SUFFIX, counts_path, read_counts
from compass.model.training.windows import SourceSize, Window, stage_windows

log = logging.getLogger("compass.train")
NPY_HEADER_BYTES = 512  # numpy pads an .npy header to a multiple of 64 bytes; a 1-D array's fits in 128


def is_training_tokens(path: str) -> bool:
    return path.startswith(f"{TRAIN}/") and path.endswith(TOKENS_SUFFIX)


def stage_sources(staging: Staging, local_rank: int, rows: range, total_rows: int, workdir: Path | None = None,
                  timeout_s: float = 6 * 3600, recipe: StageRecipe | None = None) -> dict[str, Path]:
    """The node-local copy of every source for the node's rows `rows` of `total_rows` (made here on local rank
    0, awaited on the others), of the documents `recipe`'s stage reads (its windows: model/training/windows.py;
    without a recipe, every document). What local rank 0 copied is left in `workdir`'s resource ledger parts, one
    per node (infra/resource_ledger.py), for the step's manifest."""
    ledger = resource_ledger.Ledger()
    with resource_ledger.counting(ledger):
        staged = _stage(staging, local_rank, rows, total_rows, timeout_s, recipe)
    if workdir is not None and local_rank == 0:
        ledger.write_part(workdir, f"staging-{socket.gethostname()}")
    return staged


def _stage(staging: Staging, local_rank: int, rows: range, total_rows: int, timeout_s: float,
           recipe: StageRecipe | None) -> dict[str, Path]:
    store = Store(staging.store_root)
    counted = {name: shard_counts(store, uri) for name, uri in staging.uris.items()}
    sizes = {name: SourceSize(sum(d for d, _ in c.values()), sum(t for _, t in c.values()))
             for name, c in counted.items() if all(t is not None for _, t in c.values())}
    windows = stage_windows(recipe, sizes) if recipe is not None else {}
    staged: dict[str, Path] = {}
    for name, uri in staging.uris.items():
        start = time.perf_counter()
        documents = {shard: d for shard, (d, _) in counted[name].items()}
        needed = needed_shards(documents, rows, total_rows, windows.get(name))
        # with a counts file a reader indexes the shards without their offsets: only those of the shards it reads
        indexed = name in sizes and _has_counts(store, uri)
        staged[name] = _copied(store, uri, staging, _only_shards(needed, indexed, heldout_sampled(store, uri)),
                               local_rank, timeout_s, frozenset(staged.values()))
        if local_rank == 0:
            log.info("staged %s at %s: %d of %d training shards, for rows %d-%d of %d (%.1fs)", name, staged[name],
                     len(needed), len(documents), rows.start, rows.stop - 1, total_rows, time.perf_counter() - start)
    return staged


def _has_counts(store: Store, uri: str) -> bool:
    counted = counts_path(Path(), TRAIN).as_posix()
    return any(e.path == counted for e in store.read_manifest(uri).files)


def documents_per_shard(store: Store, uri: str) -> dict[str, int]:
    """{training token shard: its documents} (shard_counts)."""
    return {shard: documents for shard, (documents, _) in shard_counts(store, uri).items()}


def shard_counts(store: Store, uri: str) -> dict[str, tuple[int, int | None]]:
    """{training token shard: (its documents, its tokens)}, from the split's counts file (one small read), or, for
    a source tokenized without one, the documents from the shape in each offsets file's header (a few hundred bytes
    read per shard; tokens unknown: None); the copy then checks every file it takes in full."""
    if _has_counts(store, uri):
        counted = counts_path(Path(), TRAIN).as_posix()
        documents, tokens = read_counts(store.read_bytes(uri, counted).decode(), f"{uri}/{counted}")
        return {f"{TRAIN}/{i:05d}{TOKENS_SUFFIX}": (n, t) for i, (n, t) in enumerate(zip(documents, tokens,
                                                                                          strict=True))}
    counts: dict[str, tuple[int, int | None]] = {}
    for entry in store.entries(store.read_manifest(uri), TRAIN):
        if entry.path.endswith(OFFSETS_SUFFIX):
            head = io.BytesIO(store.read_head(uri, entry.path, NPY_HEADER_BYTES))
            version = np.lib.format.read_magic(head)
            read_header = (np.lib.format.read_array_header_1_0 if version == (1, 0)
                           else np.lib.format.read_array_header_2_0)
            (ends,), _, _ = read_header(head)
            counts[entry.path.removesuffix(OFFSETS_SUFFIX) + TOKENS_SUFFIX] = (ends - 1, None)
    return dict(sorted(counts.items()))


def needed_shards(documents: dict[str, int], rows: range, total_rows: int, window: Window | None = None) -> set[str]:
    """The training token shards (in document order, with their documents) holding the documents rows `rows` of
    `total_rows` read from `window` of the source (default: all of it)."""
    total = sum(documents.values())
    window = window if window is not None else Window(0, total)
    blocks = [b for b in (row_documents(window.documents, r, total_rows) for r in rows) if len(b)]
    spans = [_span(window, b, total) for b in blocks]
    read = [s for pieces in spans for s in pieces]
    needed, first = set(), 0
    for shard, count in documents.items():
        if count and any(s.start < first + count and first < s.stop for s in read):
            needed.add(shard)
        first += count
    return needed


def _span(window: Window, block: range, total: int) -> list[range]:
    """A block of the window as ranges of the source's document index (two where it wraps past the end)."""
    start = window.index(block.start, total)
    end = start + len(block)
    return [range(start, end)] if end <= total else [range(start, total), range(0, end - total)]


def heldout_sampled(store: Store, uri: str) -> set[str] | None:
    """The held-out split's files the trainer's validation reads (its sample: model/training/heldout_sample.py);
    None for a source written without held-out counts (then the whole split)."""
    counted = counts_path(Path(), HELDOUT).as_posix()
    if not any(e.path == counted for e in store.read_manifest(uri).files):
        return None
    _, tokens = read_counts(store.read_bytes(uri, counted).decode(), f"{uri}/{counted}")
    return sample_files(HELDOUT, sampled_shards(tokens))


def _only_shards(shards: set[str], indexed: bool, heldout: set[str] | None = None) -> Callable[[str], bool]:
    """Every file but the training shards' token files (and, when `indexed`, offsets) other than those of
    `shards`, and the held-out shards outside `heldout` (when given)."""
    def select(path: str) -> bool:
        if is_training_tokens(path):
            return path in shards
        if heldout is not None and path.startswith(f"{HELDOUT}/"):
            return path in heldout
        if indexed and path.startswith(f"{TRAIN}/") and path.endswith(OFFSETS_SUFFIX):
            return path.removesuffix(OFFSETS_SUFFIX) + TOKENS_SUFFIX in shards
        return True
    return select


def _copied(store: Store, uri: str, staging: Staging, select: Callable[[str], bool], local_rank: int,
            timeout_s: float, keep: frozenset[Path]) -> Path:
    """The node's copy: made by local rank 0 (room made first beside it, sparing `keep`, the step's other
    copies), awaited by the others."""
    def room(copy: Path, needed: int) -> None:
        make_room(copy, needed, staging.capacity_bytes, keep)

    if local_rank == 0:
        return store.copy_verified(uri, staging.cache, select=select, before_copy=room)
    return _wait_for(store.staged_path(uri, staging.cache, select=select), timeout_s)


def _wait_for(copy: Path, timeout_s: float) -> Path:
    deadline = time.monotonic() + timeout_s
    while not (copy / MANIFEST).exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"the node's first rank did not stage {copy} within {timeout_s:.0f} s")
        time.sleep(0.2)
    return copy
