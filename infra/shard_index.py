"""Sidecar indexes of shard sets: a folder of an artifact with many files (token shards, document shards) is listed
in `<folder>.shards.jsonl`, one JSON line per file (path, size, sha256) in path order, instead of in the manifest.
The manifest names the index with the folder's count and bytes and the index's sha256, so listing, lineage and
the UI read a small manifest at a million shards, and a check compares every file's size but hashes a sample."""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Sequence

from compass.infra.manifest import DamagedManifest, FileEntry, ShardSet

INDEX_SUFFIX = ".shards.jsonl"
SAMPLE_PER_SET = 32  # files hashed per shard set by a check that is not 'full' (a fresh random draw each time)


def index_name(folder: str) -> str:
    return f"{folder}{INDEX_SUFFIX}"


def split_large_folders(entries: Sequence[FileEntry], above: int) -> tuple[list[FileEntry], dict[str, list[FileEntry]]]:
    """(files kept in the manifest, {top-level folder: its files}) where each folder holds more than `above`."""
    by_folder: dict[str, list[FileEntry]] = {}
    for entry in entries:
        if "/" in entry.path:
            by_folder.setdefault(entry.path.split("/", 1)[0], []).append(entry)
    large = {folder: sorted(members, key=lambda e: e.path) for folder, members in by_folder.items()
             if len(members) > above}
    kept = [e for e in entries if "/" not in e.path or e.path.split("/", 1)[0] not in large]
    return kept, large


def encode(members: Sequence[FileEntry]) -> bytes:
    return b"".join(json.dumps({"path": e.path, "size": e.size, "sha256": e.sha256}, separators=(",", ":")).encode()
                    + b"\n" for e in members)


def shard_set(folder: str, members: Sequence[FileEntry], body: bytes) -> ShardSet:
    return ShardSet(folder=folder, count=len(members), bytes=sum(e.size for e in members), index=index_name(folder),
                    sha256=hashlib.sha256(body).hexdigest())


def decode(body: bytes, shards: ShardSet, where: str) -> list[FileEntry]:
    """The index's entries, or DamagedManifest when it is not the one the manifest names (changed, truncated)."""
    if hashlib.sha256(body).hexdigest() != shards.sha256:
        raise DamagedManifest(f"{where}/{shards.index}: the shard index differs from the one its manifest names")
    members = [FileEntry.model_validate_json(line) for line in body.splitlines() if line]
    if len(members) != shards.count or any(not e.path.startswith(f"{shards.folder}/") for e in members):
        raise DamagedManifest(f"{where}/{shards.index}: not an index of {shards.count} files under {shards.folder}/")
    return members


def sample(members: Sequence[FileEntry], k: int = SAMPLE_PER_SET) -> set[str]:
    """The paths a check hashes: a fresh random draw, so repeated checks cover different shards."""
    return {e.path for e in random.SystemRandom().sample(list(members), min(k, len(members)))}
