"""What a shared worker may read from its own disk on behalf of a submitted spec.

A person running their own spec may point a source anywhere. A spec submitted to a worker runs with the
worker's files: a local `uri: /etc` would copy them into an artifact the submitter can download. A run started
by a deployment therefore reads local sources and datasets only under the worker's own roots, from its
environment (`compass worker --store --specs` sets the first two): its store (COMPASS_WORKER_STORE), the folder
it keeps submitted specs in (COMPASS_WORKER_SPECS) and the folders in COMPASS_ALLOWED_ROOTS (os.pathsep-separated).
The flow's parameters (base_dir, store_root) are the submitter's: they never widen them. Packages and S3 are not
affected. It writes only under the worker's store and COMPASS_ALLOWED_ROOTS: its store, and every other folder the
spec names (node-local staging, the shared root, the monitoring folder, an MLflow database), else it is refused
before any step, naming the field.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

from compass.specs.base import Issue, Loc
from compass.specs.how import tracking_folder
from compass.specs.smoke import sized_root
from compass.specs.sources import parse_source_uri
from compass.specs.spec import TrainingSpec

ALLOWED_ROOTS = "COMPASS_ALLOWED_ROOTS"
WORKER_STORE = "COMPASS_WORKER_STORE"
WORKER_SPECS = "COMPASS_WORKER_SPECS"


def allowed_roots(spec_folder: Path | None, store_root: str | None) -> list[Path]:
    """A spec folder, a local store (an s3:// one holds no local files) and COMPASS_ALLOWED_ROOTS, resolved."""
    local_store = (store_root or "").removeprefix("file://")
    roots = [r for r in (spec_folder, Path(local_store) if local_store and "://" not in local_store else None) if r]
    roots += [Path(p) for p in os.environ.get(ALLOWED_ROOTS, "").split(os.pathsep) if p]
    return [r.expanduser().resolve() for r in roots]


def worker_roots() -> list[Path]:
    """The roots of a run a deployment started: the worker's own, from its environment alone."""
    specs = os.environ.get(WORKER_SPECS)
    return allowed_roots(Path(specs) if specs else None, os.environ.get(WORKER_STORE) or None)


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


def worker_read_warnings(spec: TrainingSpec, base_dir: Path) -> list[str]:
    """What `compass submit` warns of: each local file the run reads is read from the worker's disk, under its own
    roots, not from the submitter's (the run fails at its start, naming the field, where the worker lacks it)."""
    return [f"warning: {'.'.join(str(part) for part in loc)}: the worker reads {uri} from its own disk ({path} "
            f"there, under its --store, --specs or {ALLOWED_ROOTS}); put it on S3 where the worker is another "
            f"machine" for loc, uri, path in local_paths(spec, base_dir)] + [
        f"warning: {'.'.join(str(part) for part in loc)}: the worker writes {written} on its own disk ({path} there); "
        f"it refuses the run unless that is under its --store or {ALLOWED_ROOTS}"
        for loc, written, path in spec_write_paths(spec, base_dir)]


def outside_roots(spec: TrainingSpec, base_dir: Path, roots: list[Path]) -> Iterator[Issue]:
    """Every local path the spec reads that resolves (symlinks and '..' followed) outside `roots`."""
    for loc, uri, path in local_paths(spec, base_dir):
        if not any(path.is_relative_to(root) for root in roots):
            yield Issue(loc, f"{uri} resolves to {path}, outside the folders this worker reads for submitted specs "
                        f"({', '.join(str(r) for r in roots) or 'none'})", f"put the data on S3 or under the "
                        f"worker's store or spec folder ({WORKER_STORE}, {WORKER_SPECS}), or add its folder to "
                        f"{ALLOWED_ROOTS} in the worker's environment")


def worker_store(spec_root: str, size: str) -> str | None:
    """The store a run a deployment started writes when its submitter named none: the worker's own (`compass worker
    --store`, beside it at smoke or rehearsal size) in place of a local `how.storage.root`, which names a folder of
    the submitter's machine; an s3:// root is the spec's own bucket and stays. None: the spec's root (a worker started
    without `--store`)."""
    own = os.environ.get(WORKER_STORE)
    if not own or ("://" in spec_root and not spec_root.startswith("file://")):
        return None
    return own if size == "full" else sized_root(own, size)


def worker_write_roots() -> list[Path] | None:
    """The folders a run a deployment started may write under: the worker's local store (its smoke and rehearsal
    namespaces beside it included) and COMPASS_ALLOWED_ROOTS, resolved. None: a worker started without `--store`,
    whose runs write where their spec says."""
    own = os.environ.get(WORKER_STORE)
    if not own:
        return None
    roots = [Path(p).expanduser().resolve() for p in os.environ.get(ALLOWED_ROOTS, "").split(os.pathsep) if p]
    if "://" in own and not own.startswith("file://"):
        return roots  # an s3:// store holds no local folder: only the allowed roots
    store = Path(own.removeprefix("file://")).expanduser().resolve()
    return [store, *(store.with_name(f"{store.name}-{size}") for size in ("smoke", "rehearsal")), *roots]


def store_outside_worker(root: str) -> str | None:
    """Why a run a deployment started may not write its store at `root` (None: it may). A worker started with
    `--store` writes only into that store (its smoke and rehearsal namespaces beside it included) or under
    COMPASS_ALLOWED_ROOTS, whatever `store_root` the submitter passed; an s3:// store is the spec's own bucket, and a
    worker started without `--store` confines nothing."""
    roots = worker_write_roots()
    if roots is None or ("://" in root and not root.startswith("file://")):
        return None
    path = Path(root.removeprefix("file://")).expanduser().resolve()
    if any(path.is_relative_to(r) for r in roots):
        return None
    store = os.environ[WORKER_STORE]
    return (f"{path} is outside the stores this worker writes ({store}, or under {ALLOWED_ROOTS}): submit without "
            f"--store (the run then writes this worker's store), or start a worker with --store {path}")


def spec_write_paths(spec: TrainingSpec, base_dir: Path) -> list[tuple[Loc, str, Path]]:
    """(field, as written, resolved folder) of every local folder the spec itself names for a run to write under,
    besides its store: node-local staging, the cluster's shared root, the monitoring folder and an MLflow database
    or file store (relative ones from the spec's folder, links and '..' followed, as the write reaches them)."""
    how = spec.how
    named = [(("how", "storage", "local_cache"), how.storage.local_cache),
             (("how", "monitoring", "folder"), how.monitoring.folder),
             (("how", "orchestration", "cluster", "shared_root"), how.orchestration.shared_root)]
    uri = how.monitoring.mlflow_tracking_uri
    if folder := tracking_folder(uri):
        named.append((("how", "monitoring", "mlflow_tracking_uri"), folder))
    out = []
    for loc, folder in named:
        if folder and ("://" not in folder or folder.startswith("file://")):
            local = Path(folder.removeprefix("file://")).expanduser()
            out.append((loc, folder, Path(os.path.realpath(base_dir / local))))
    return out


def writes_outside_worker(spec: TrainingSpec, base_dir: Path) -> Iterator[Issue]:
    """Every folder a submitted spec names for its run to write under that lies outside the worker's write roots:
    refused before any step, so a submitter cannot make a shared worker write its disk anywhere it can reach."""
    roots = worker_write_roots()
    if roots is None:
        return
    for loc, written, path in spec_write_paths(spec, base_dir):
        if not any(path.is_relative_to(root) for root in roots):
            yield Issue(loc, f"{written} resolves to {path}, outside the folders this worker writes for submitted "
                        f"specs ({', '.join(str(r) for r in roots) or 'none'})",
                        f"leave the field out (the run then uses this worker's own), or add its folder to "
                        f"{ALLOWED_ROOTS} in the worker's environment")
