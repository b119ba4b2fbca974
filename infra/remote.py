"""Local copies of remote data a spec names by URI (an s3:// prefix of datasets, a checkpoint), through fsspec.

A copy is downloaded once into the cache (`COMPASS_CACHE`, default ~/.cache/compass/remote), into a temporary
folder renamed into place when complete, and reused while the objects keep their sizes and ETags.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from compass.infra.errors import DataError
from compass.infra.manifest import stays_inside


class RemoteMissing(FileNotFoundError, DataError):
    """A URI with nothing under it."""


class UnsafeKey(DataError, ValueError):
    """An object whose key under the URI has a '..' part or makes an absolute path: copied, it would land
    outside the local copy (anywhere this user can write)."""


def cache_root() -> Path:
    return Path(os.environ.get("COMPASS_CACHE", Path.home() / ".cache" / "compass")) / "remote"


def listing(uri: str) -> tuple[Any, dict[str, dict[str, Any]]]:
    """(filesystem, {relative path: info with its remote "name"}) of every object at or under `uri`."""
    import fsspec

    fs, root = fsspec.core.url_to_fs(uri)
    root = root.rstrip("/")
    try:
        found = {p: i for p, i in fs.find(root, detail=True).items() if i.get("type", "file") != "directory"}
    except FileNotFoundError:
        found = {}
    if not found:
        raise RemoteMissing(f"{uri}: no objects there (check the bucket, the prefix and the credentials)")
    if list(found) == [root]:  # the URI names one object
        return fs, {Path(root).name: {**found[root], "name": root}}
    return fs, {p[len(root) + 1:]: {**i, "name": p} for p, i in found.items()}


def local_copy(uri: str) -> Path:
    """A local folder holding the objects under `uri` (downloaded when missing or changed)."""
    fs, files = listing(uri)
    unsafe = sorted(rel for rel in files if not stays_inside(rel))
    if unsafe:
        raise UnsafeKey(f"{uri}: objects whose keys leave the prefix ({', '.join(unsafe[:3])}"
                        f"{f' and {len(unsafe) - 3} more' if len(unsafe) > 3 else ''}): nothing copied; rename them")
    signature = hashlib.sha256(json.dumps({p: [i.get("size"), str(i.get("ETag") or i.get("etag") or "")]
                                           for p, i in sorted(files.items())}).encode()).hexdigest()[:16]
    folder = cache_root() / f"{hashlib.sha256(uri.encode()).hexdigest()[:16]}-{signature}"
    if folder.exists():
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    partial = Path(tempfile.mkdtemp(prefix=folder.name + ".part-", dir=folder.parent))
    try:
        for rel, info in files.items():
            target = partial / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            fs.get_file(info["name"], str(target))
        (partial / ".source.json").write_text(json.dumps({"uri": uri, "objects": len(files)}))
        with contextlib.suppress(OSError):  # another process finished the same download first
            partial.rename(folder)
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return folder
