"""What a shared worker may read from its own disk on behalf of a submitted spec.

A person running their own spec may point a source anywhere. A spec submitted to a worker runs with the
worker's files: a local `uri: /etc` would copy them into an artifact the submitter can download. A run started
by a deployment therefore reads local sources and datasets only under allowed roots: the spec's folder, a local
store, and the folders listed in the worker's COMPASS_ALLOWED_ROOTS (os.pathsep-separated). Packages and S3
are not affected.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

from compass.specs.base import Issue, Loc
from compass.specs.sources import parse_source_uri
from compass.specs.spec import TrainingSpec

ALLOWED_ROOTS = "COMPASS_ALLOWED_ROOTS"


def allowed_roots(base_dir: Path, store_root: str) -> list[Path]:
    roots = [base_dir] + ([] if "://" in store_root else [Path(store_root)])
    roots += [Path(p) for p in os.environ.get(ALLOWED_ROOTS, "").split(os.pathsep) if p]
    return [r.expanduser().resolve() for r in roots]


def local_paths(spec: TrainingSpec, base_dir: Path) -> list[tuple[Loc, str, Path]]:
    """(field, as written, resolved path) of every local file or folder the spec's data steps read: local sources
    and post-training datasets (symlinks and '..' followed)."""
    names = {s.name for s in spec.what.data.sources}
    paths = [(("what", "data", "sources", i, "uri"), s.uri) for i, s in enumerate(spec.what.data.sources)]
    paths += [(("what", "post_training", i, "dataset"), p.dataset) for i, p in enumerate(spec.what.post_training)
              if getattr(p, "dataset", None) and p.dataset not in names]
    out = []
    for loc, uri in paths:
        parsed = parse_source_uri(uri)
        if parsed.scheme == "file":
            out.append((loc, uri, (base_dir / parsed.path).expanduser().resolve()))
    return out


def outside_roots(spec: TrainingSpec, base_dir: Path, roots: list[Path]) -> Iterator[Issue]:
    """Every local path the spec reads that resolves (symlinks and '..' followed) outside `roots`."""
    for loc, uri, path in local_paths(spec, base_dir):
        if not any(path.is_relative_to(root) for root in roots):
            yield Issue(loc, f"{uri} resolves to {path}, outside the folders this worker reads for submitted specs "
                        f"({', '.join(str(r) for r in roots)})", f"put the data under the spec's folder or on "
                        f"S3, or add its folder to {ALLOWED_ROOTS} in the worker's environment")
