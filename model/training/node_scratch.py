"""Room on a node's local disk for a step's staged copy (how.storage.local_cache, local_cache_gib).

Staged copies outlive their step so that a requeued job or the next stage with the same rows starts at once; left
alone they would fill the disk stage after stage (SmolLM3's stages and context extensions each stage their own
windows). Before a copy, the least recently used other copies (a reused copy is marked used) are removed until
the new one fits both the capacity the spec gives and the disk's free space; a copy that cannot fit stops the
step with what it needs and what is there, before a byte is copied.
"""

from __future__ import annotations

import fcntl
import logging
import shutil
from pathlib import Path

from compass.infra.manifest import MANIFEST
from compass.infra.store import LOCKS

log = logging.getLogger("compass.train")


class ScratchFull(OSError):
    """The node's local disk cannot hold the step's copy, even with every other copy removed."""


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def make_room(target: Path, needed: int, capacity: int | None, keep: frozenset[Path] = frozenset()) -> list[Path]:
    """Remove the least recently used copies beside `target` (a copy's folder: neither it, its partial copy nor
    `keep`, the step's other copies, are removed; nor a copy in progress of another process: its lock is held)
    until `needed` more bytes fit `capacity` (bytes; None: the disk alone) and the disk's free space. Returns what
    was removed; ScratchFull when it cannot fit."""
    cache_dir = target.parent
    spared = {target, target.with_name(target.name + ".part"), *keep}
    removed: list[Path] = []
    held = {p: folder_bytes(p) for p in _copies(cache_dir)}  # each copy's files listed once
    copies = sorted((p for p in held if p not in spared), key=_last_used)

    def fits() -> bool:
        free = shutil.disk_usage(cache_dir).free
        return needed <= free and (capacity is None or sum(held.values()) + needed <= capacity)

    for copy in copies:
        if fits():
            break
        lock = cache_dir / LOCKS / (copy.name.removesuffix(".part") + ".lock")
        if copy.name.endswith(".part") and lock.exists():
            with open(lock, "a") as busy:
                try:
                    fcntl.flock(busy, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    continue  # being copied by another process now
                fcntl.flock(busy, fcntl.LOCK_UN)
        log.info("removing the staged copy %s (least recently used) to make room", copy)
        shutil.rmtree(copy, ignore_errors=True)
        held.pop(copy)
        removed.append(copy)
    if not fits():
        limit = f"local_cache_gib {capacity / 1024**3:,.1f} GiB, " if capacity is not None else ""
        raise ScratchFull(f"{cache_dir}: the step's copy needs {needed / 1024**3:,.2f} GiB more; {limit}"
                          f"{sum(held.values()) / 1024**3:,.2f} GiB held by copies in use, "
                          f"{shutil.disk_usage(cache_dir).free / 1024**3:,.2f} GiB free on the disk (point "
                          "how.storage.local_cache at a larger disk, or give the phase more nodes)")
    return removed


def _copies(cache_dir: Path) -> list[Path]:
    """Every copy and partial copy under `cache_dir`."""
    return [p for p in cache_dir.iterdir() if p.is_dir() and not p.name.startswith(".")]


def _last_used(copy: Path) -> float:
    marker = copy / MANIFEST
    return marker.stat().st_mtime if marker.exists() else copy.stat().st_mtime
