"""Local sources' listings, read when the spec loads: a digest of the files a local source folder holds (paths under
it, sizes, modification times) goes into the ingest step's identity, so a file edited, added or removed after an
ingest runs the ingest again instead of reusing a stale artifact (as a starting checkpoint's stamp does)."""

from __future__ import annotations

import fnmatch
import hashlib
import json
import os
from pathlib import Path

from compass.specs.base import Issue
from compass.specs.sources import SourceUriError, parse_source_uri
from compass.specs.spec import TrainingSpec


def resolve_local_sources(spec: TrainingSpec, base_dir: Path) -> tuple[TrainingSpec, list[Issue]]:
    """The spec with each local source's `listing` filled in (a missing folder is left to the machine checks);
    a listing written by hand is refused."""
    sources = spec.what.data.sources
    issues = [Issue(("what", "data", "sources", i, "listing"), "listing is filled in by compass when it loads "
                    "the spec", "remove it") for i, s in enumerate(sources) if "listing" in s.model_fields_set]
    if issues:
        return spec, issues
    resolved = []
    for src in sources:
        try:
            uri = parse_source_uri(src.uri)
        except SourceUriError:  # the spec's checks name it
            resolved.append(src)
            continue
        folder = (base_dir / uri.path).expanduser() if uri.scheme == "file" else None
        if folder is not None and folder.is_dir():
            src = src.model_copy(update={"listing": listing_digest(folder, src.include, src.exclude)})
        resolved.append(src)
    data = spec.what.data.model_copy(update={"sources": resolved})
    return spec.model_copy(update={"what": spec.what.model_copy(update={"data": data})}), []


def listing_digest(folder: Path, include: list[str], exclude: list[str]) -> str:
    """sha256 of the sorted (path under `folder`, size, mtime in ns) of the files the patterns select, links
    followed."""
    import fsspec

    fs = fsspec.filesystem("file")
    root = str(folder.resolve())
    rows = set()
    for pattern in include:
        for path in fs.glob(f"{root}/{pattern}"):
            rel = path[len(root) + 1:]
            if any(fnmatch.fnmatch(rel, ex) for ex in exclude):
                continue
            try:
                st = os.stat(path)
            except OSError:
                continue
            if os.path.isfile(path):
                rows.add((rel, st.st_size, st.st_mtime_ns))
    return hashlib.sha256(json.dumps(sorted(rows)).encode()).hexdigest()
