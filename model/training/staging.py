"""Node-local staging of the training data, done by the trainer itself so that it happens on every node.

SmolLM3's run lost throughput to a shared file system that evicted dataset shards until the data was moved to
local NVMe on every node. With `how.storage.local_cache`, the first rank of each node copies the tokenized sources
from the store (local or S3) into that folder, each file checked against its manifest's sha256, before any rank
reads; the node's other ranks wait for the copies. A complete copy whose sizes still match is reused, so a
requeued job or the next stage starts at once.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

from compass.infra.manifest import MANIFEST
from compass.infra.store import Store
from compass.model.training.job import Staging

log = logging.getLogger("compass.train")


def stage_sources(staging: Staging, local_rank: int, timeout_s: float = 6 * 3600) -> dict[str, Path]:
    """The node-local copy of every source (made here on local rank 0, awaited on the others)."""
    store = Store(staging.store_root)
    staged: dict[str, Path] = {}
    for name, uri in staging.uris.items():
        if local_rank == 0:
            start = time.perf_counter()
            staged[name] = store.copy_verified(uri, staging.cache)
            log.info("staged %s at %s (%.1fs)", name, staged[name], time.perf_counter() - start)
        else:
            staged[name] = _wait_for(store.staged_path(uri, staging.cache), timeout_s)
    return staged


def _wait_for(copy: Path, timeout_s: float) -> Path:
    deadline = time.monotonic() + timeout_s
    while not (copy / MANIFEST).exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"the node's first rank did not stage {copy} within {timeout_s:.0f} s")
        time.sleep(0.2)
    return copy
