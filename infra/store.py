"""The artifact store: one folder per step output under a local root or an s3:// prefix (via fsspec).

A step writes into a local staging folder; `commit` moves (local) or uploads (s3) it to its final place and
writes `manifest.json` last, so an artifact without a manifest is never taken for done.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import shutil
import socket
import tempfile
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO

import fsspec
import psutil
from fsspec.core import url_to_fs

from compass.infra import resource_ledger, shard_index
from compass.infra.errors import RootRefused
from compass.infra.fingerprint import sha256_file
from compass.infra.manifest import MANIFEST, DamagedManifest, FileEntry, Manifest, parse_manifest, relocated
from compass.infra.process_identity import identity_of
from compass.infra.verified_read import verified
from compass.specs.how import write_root_problem

INDEXES_KEPT = 8  # shard indexes a Store keeps decoded
STORE_MARKER = ".compass-store"  # at a store's root, written before its first artifact


def artifact_folder(kind: str, name: str, fingerprint: str) -> str:
    return f"{kind}/{name}-{fingerprint[:12]}"


def checked_manifest(fs: fsspec.AbstractFileSystem, path: str, uri: str) -> Manifest:
    """The manifest of the artifact folder at `path` (on `fs`) that `uri` names, relocated there; DamagedManifest
    when it cannot describe that folder: a folder (or its kind's folder) that is a link, a manifest that does not
    parse, or one naming another kind, name or fingerprint (another artifact's data taken for this one)."""
    if _is_link(fs, path):
        raise DamagedManifest(f"{uri} is a link to {os.path.realpath(path)}, not an artifact folder of its own")
    manifest = parse_manifest(fs.cat_file(f"{path}/{MANIFEST}"), uri)
    named = artifact_folder(manifest.kind, manifest.name, manifest.fingerprint)
    if not uri.rstrip("/").endswith(f"/{named}"):
        raise DamagedManifest(f"{uri}: its manifest describes another artifact ({named})")
    return relocated(manifest, uri)


def inside_folder(root: Path, folder: Path, what: str) -> Path:
    """`folder` (a store's own folder: a kind's, `.staging`, `.damaged`) where it is, neither a link nor reaching
    outside `root` through one: a link planted there would make compass write (or move an artifact) into the
    folder it names. RootRefused says which and what to do."""
    if folder.is_symlink():
        raise RootRefused(f"{folder} ({what}) is a link to {os.path.realpath(folder)}, not a folder of the store "
                          f"{root}: remove the link (compass makes the folder)")
    real, real_root = Path(os.path.realpath(folder)), Path(os.path.realpath(root))
    if folder.exists() and not real.is_relative_to(real_root):
        raise RootRefused(f"{folder} ({what}) resolves to {real}, outside the store {real_root}: remove the link "
                          f"on its way")
    return folder


def _is_link(fs: fsspec.AbstractFileSystem, path: str) -> bool:
    """Whether a local artifact folder or its kind's folder is a symbolic link (objects on S3 are never links)."""
    from fsspec.implementations.local import LocalFileSystem

    folder = path.rstrip("/")
    return isinstance(fs, LocalFileSystem) and (os.path.islink(folder) or os.path.islink(os.path.dirname(folder)))


_STAGED = re.compile(r"(step|scratch)-(?P<pid>\d+)(\.(?P<ticks>\d+)\.(?P<boot>[0-9a-f]{8}))?@(?P<host>.*)"
                     r"-[A-Za-z0-9_]+(\.moving)?")


def owned_prefix(label: str) -> str:
    """Prefix of a temporary folder that names its process (pid, start ticks and boot: infra/process_identity.py)
    and host, so a sweep can tell a dead owner's, whatever the clock did meanwhile."""
    me = identity_of(os.getpid())
    named = f"{os.getpid()}.{me.ticks}.{me.boot.replace('-', '')[:8]}" if me else str(os.getpid())
    return f"{label}-{named}@{socket.gethostname()}-"


def _sweep_staging(base: Path) -> None:
    """Remove what killed processes of this machine left half-written (their staging folders); a live
    process's folder, or another machine's, is never touched."""

    host = socket.gethostname()
    for folder in base.iterdir():
        match = _STAGED.fullmatch(folder.name)
        if match and match["host"] == host and not _owner_alive(int(match["pid"]), folder, match["ticks"],
                                                                 match["boot"]):
            shutil.rmtree(folder, ignore_errors=True)


def _owner_alive(pid: int, folder: Path, ticks: str | None = None, boot: str | None = None) -> bool:
    """Whether the process that made `folder` still runs: the one its name records (pid, start ticks, boot), or,
    for a folder named by an older compass, a process of that PID that started before the folder was last written
    (a busy machine reuses the PID of a killed run for a process that started later)."""
    if ticks is not None and boot is not None:
        now = identity_of(pid)
        return now is not None and now.ticks == int(ticks) and now.boot.replace("-", "")[:8] == boot
    try:
        started = psutil.Process(pid).create_time()
        changed = folder.stat().st_mtime
    except (psutil.Error, FileNotFoundError):
        return False
    return started <= changed + 1.0  # create_time is rounded to the clock tick


STORE_SCHEMES = ("s3",)  # besides local folders (plain paths or file://): what the store writes and commits to


def root_problem(root: str) -> str | None:
    """Why `root` cannot hold a store, or None: checked before Store() makes folders or opens a filesystem, so a
    wrong `--store` ends in one sentence instead of a traceback from mkdir or from an HTTP client."""
    if "://" in root and not root.startswith("file://"):
        scheme = root.split("://", 1)[0]
        if scheme not in STORE_SCHEMES:
            return (f"{scheme}:// cannot hold a store (compass writes and commits artifacts there): give a local "
                    "folder or s3://bucket/prefix")
        return None

    system = write_root_problem(root)
    if system:
        return system
    path = Path(root.removeprefix("file://")).expanduser().absolute()
    for folder in (path, *path.parents):
        if os.path.exists(folder) and not os.path.isdir(folder):
            return (f"{folder} is a file, not a folder" if folder == path else
                    f"{folder} is a file, so there can be no folder {path} under it")
    return None


def _cache_home() -> Path:
    return Path(os.environ.get("COMPASS_CACHE", Path.home() / ".cache" / "compass"))


LOCKS = ".locks"  # beside staged copies: one lock file per copy, held while it is made


class Store:
    """Content-addressed artifacts with lineage manifests, on any fsspec filesystem.

    `scratch_root`, when given (a cluster's shared root), holds what a step writes outside the store while it runs
    (work folders, staging, copies of a remote store's inputs, monitoring) so that every node of a job sees it;
    without it they stay beside a local store, or in this machine's cache and temporary folders."""

    def __init__(self, root: str, scratch_root: str | Path | None = None, create: bool = True):
        """`create=False`: only read (a plan of a store that does not exist yet creates nothing)."""
        self.scratch_root = Path(scratch_root).expanduser().resolve() if scratch_root else None
        self.is_remote = "://" in root and not root.startswith("file://")
        if not self.is_remote:
            root = str(Path(root.removeprefix("file://")).expanduser().resolve())
        self.root = root.rstrip("/")
        self.fs: fsspec.AbstractFileSystem
        self.fs, self.root_path = url_to_fs(self.root)
        if not self.is_remote and create:
            Path(self.root).mkdir(parents=True, exist_ok=True)
        self._marked = False  # STORE_MARKER known to be there
        self._indexes: dict[tuple[str, str], list[FileEntry]] = {}  # shard indexes read, by (uri, their sha256)

    # --- addressing -------------------------------------------------------------------------------------
    def uri(self, kind: str, name: str, fingerprint: str) -> str:
        return f"{self.root}/{artifact_folder(kind, name, fingerprint)}"

    def path_of(self, uri: str) -> str:
        """fsspec path (no protocol) of a URI inside this store."""
        if uri != self.root and not uri.startswith(self.root.rstrip("/") + "/"):  # /store-old is not in /store
            raise ValueError(f"{uri} is not inside the store {self.root}")
        return self.root_path + uri[len(self.root):]

    # --- the store itself ----------------------------------------------------------------------------------
    def is_marked(self) -> bool:
        """Whether a compass store is here: what `compass verify` acts on (another program's folder never is)."""
        self._marked = self._marked or self.fs.exists(f"{self.root_path}/{STORE_MARKER}")
        return self._marked

    def _mark(self) -> None:
        """Mark the root as a compass store, once, before its first artifact (a small file, never rewritten)."""
        if self.is_marked():
            return
        body = json.dumps({"compass_store": 1, "why": "compass verify acts only on folders holding this file"})
        if self.is_remote:
            with self.fs.open(f"{self.root_path}/{STORE_MARKER}", "w") as f:
                f.write(body)
        else:
            Path(self.root, STORE_MARKER).write_text(body)
        self._marked = True

    # --- reading ----------------------------------------------------------------------------------------
    def is_committed(self, uri: str) -> bool:
        return self.fs.exists(f"{self.path_of(uri)}/{MANIFEST}")

    def read_manifest(self, uri: str) -> Manifest:
        """The artifact's manifest; DamagedManifest when it cannot describe the artifact (`checked_manifest`)."""
        return checked_manifest(self.fs, self.path_of(uri), uri)

    def committed(self, kind: str, name: str | None = None) -> list[Manifest]:
        """Committed artifacts of one kind (of one step name, any fingerprint, when given), newest first; a damaged
        manifest is none (the step that owns it sets it aside when it runs), so it never stops a plan."""
        manifests = []
        for path in self.fs.glob(f"{self.root_path}/{kind}/{name + '-' if name else ''}*/{MANIFEST}"):
            folder = path.rsplit("/", 2)[-2]
            if name is not None and folder[: -13] != name:  # 'name-<12 hex>': reject names that merely start alike
                continue
            where = self.root + path[len(self.root_path):].removesuffix(f"/{MANIFEST}")
            try:
                manifests.append(self.read_manifest(where))
            except DamagedManifest:
                continue
        return sorted(manifests, key=lambda m: m.finished_at, reverse=True)

    def read_bytes(self, uri: str, relative: str) -> bytes:
        """One file of an artifact."""
        with self.fs.open(f"{self.path_of(uri)}/{relative}", "rb") as f:
            return f.read()

    def read_head(self, uri: str, relative: str, size: int) -> bytes:
        """The first `size` bytes of one file of an artifact (a header), without reading the rest."""
        with self.fs.open(f"{self.path_of(uri)}/{relative}", "rb", block_size=size) as f:
            return f.read(size)

    def folder_url(self, uri: str, under: str) -> str:
        """A committed artifact's sub-folder as a URL a library reads directly (a local path, or s3://...)."""
        return f"{self.path_of(uri)}/{under}" if not self.is_remote else f"{uri.rstrip('/')}/{under}"

    @contextmanager
    def open_committed(self, uri: str, entry: FileEntry) -> Iterator[BinaryIO]:
        """One file of a committed artifact as a stream, with no local copy: from S3 it is hashed as it is read
        and checked against the manifest at its end (infra/verified_read.py); a local store's files were checked
        before the step (infra/verify.py)."""
        path = f"{self.path_of(uri)}/{entry.path}"
        if not self.is_remote:
            with open(path, "rb") as f:
                yield f
            return

        with self.fs.open(path, "rb", block_size=1 << 22) as raw, verified(raw, entry, f"{uri}/{entry.path}") as f:
            yield f

    def local_path(self, uri: str, cache_dir: Path | None = None, only: str | None = None,
                   select: Callable[[str], bool] | None = None) -> Path:
        """A local folder with the artifact's files: the folder itself, or a verified download from S3
        (`only`: just the files under that sub-folder, e.g. one checkpoint of a model artifact; `select`: those
        whose relative paths it accepts)."""
        if not self.is_remote:
            return Path(self.path_of(uri))
        return self.copy_verified(uri, cache_dir or self._local_base("cache", Path(tempfile.gettempdir()) /
                                                                     "compass-cache"), only, select)

    def staged_path(self, uri: str, cache_dir: Path, only: str | None = None,
                    select: Callable[[str], bool] | None = None) -> Path:
        """Where `copy_verified` puts (or has put) the artifact under `cache_dir`."""
        manifest = self.read_manifest(uri)
        files = self._selected(manifest, only, select)
        # keyed by the files' checksums too: a store rebuilt under the same fingerprints (its sources changed
        # underneath) must not be served from an older copy
        content = hashlib.sha256("".join(f"{e.path}\0{e.sha256}\0" for e in files).encode()).hexdigest()[:12]
        return cache_dir / f"{manifest.fingerprint}-{content}"

    def copy_verified(self, uri: str, cache_dir: Path, only: str | None = None,
                      select: Callable[[str], bool] | None = None,
                      before_copy: Callable[[Path, int], None] | None = None) -> Path:
        """The artifact's files copied under `cache_dir` (a download from S3, or node-local staging from any
        store), each checked against the manifest's sha256 as it arrives; a complete copy (its manifest written
        last) whose file sizes still match is reused, and marked used (its manifest's mtime). `select`: only the
        files whose relative paths it accepts (a copy of another selection is another folder). A copy cut short
        (a killed job, a requeue) is resumed: the files it verified stay (`.part/.verified`); processes copying
        the same folder take turns (a lock file in `cache_dir/.locks`). `before_copy(the copy's folder, bytes
        still to copy)` runs first (node-local staging makes room beside it)."""
        manifest = self.read_manifest(uri)
        files = self._selected(manifest, only, select)
        cache = self.staged_path(uri, cache_dir, only, select)
        done = cache / MANIFEST
        (cache_dir / LOCKS).mkdir(parents=True, exist_ok=True)
        with open(cache_dir / LOCKS / f"{cache.name}.lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if done.exists() and any(not (cache / e.path).is_file()
                                     or (cache / e.path).stat().st_size != e.size for e in files):
                shutil.rmtree(cache, ignore_errors=True)  # a copy altered since: copy again
            if done.exists():
                os.utime(done)  # used now: the last to be removed to make room
                return cache
            partial = cache.with_name(cache.name + ".part")
            verified_list = partial / ".verified"
            kept = set(verified_list.read_text().split("\n")) if verified_list.exists() else set()
            kept = {e.path for e in files if e.path in kept and (partial / e.path).is_file()
                    and (partial / e.path).stat().st_size == e.size}
            remaining = [e for e in files if e.path not in kept]
            if before_copy is not None:
                before_copy(cache, sum(e.size for e in remaining))
            resource_ledger.count_copied(sum(e.size for e in remaining))  # a reused copy costs no copy
            partial.mkdir(parents=True, exist_ok=True)
            with open(verified_list, "a") as record:
                for entry in remaining:
                    target = partial / entry.path
                    target.parent.mkdir(parents=True, exist_ok=True)
                    self.fs.get_file(f"{self.path_of(uri)}/{entry.path}", str(target))
                    if sha256_file(str(target)) != entry.sha256:
                        target.unlink(missing_ok=True)
                        raise OSError(f"checksum mismatch for {uri}/{entry.path}: the store's file differs from "
                                      "its manifest (`compass verify` the store)")
                    record.write(entry.path + "\n")
                    record.flush()
            verified_list.unlink()
            (partial / MANIFEST).write_text(manifest.model_dump_json(indent=2))
            partial.rename(cache)
        return cache

    def _selected(self, manifest: Manifest, only: str | None,
                  select: Callable[[str], bool] | None) -> list[FileEntry]:
        return [e for e in self.entries(manifest, only) if select is None or select(e.path)]

    def work_dir(self, kind: str, name: str, fingerprint: str) -> Path:
        """A local folder that survives a crashed attempt of one step (checkpoints), keyed by its identity and,
        for a remote store, by the store: the same step of two stores (another bucket, or one bucket name on
        another S3 server) never shares completion markers or written-file records on this machine."""
        if not self.is_remote:
            return Path(self.root) / ".work" / artifact_folder(kind, name, fingerprint)
        base = self._local_base("work", _cache_home() / "work") / self._remote_key()
        return base / artifact_folder(kind, name, fingerprint)

    def _remote_key(self) -> str:
        """The remote store as this machine reaches it: its root URL and, for S3, its endpoint."""
        kwargs = getattr(self.fs, "client_kwargs", None) or {}
        endpoint = (getattr(self.fs, "endpoint_url", None) or kwargs.get("endpoint_url")
                    or os.environ.get("AWS_ENDPOINT_URL", ""))
        return hashlib.sha256(f"{endpoint}|{self.root}".encode()).hexdigest()[:12]

    def monitoring_dir(self, run: str) -> Path:
        """A run's live telemetry (Prometheus targets, TensorBoard runs): inside a local store, else in the cache."""
        if self.is_remote:
            return self._local_base("monitoring", _cache_home() / "monitoring") / run
        return Path(self.root) / "monitoring" / run

    def _local_base(self, name: str, default: Path) -> Path:
        """A remote store's local folder of one sort: under the scratch root when there is one."""
        return self.scratch_root / name if self.scratch_root else default

    # --- writing ----------------------------------------------------------------------------------------
    @contextmanager
    def staging(self) -> Iterator[Path]:
        """A fresh local folder to write an artifact into; removed afterwards unless committed (moved)."""
        base = (self._local_base("staging", Path(tempfile.gettempdir()) / "compass-staging") if self.is_remote
                else inside_folder(Path(self.root), Path(self.root) / ".staging", "half-written artifacts"))
        base.mkdir(parents=True, exist_ok=True, mode=0o700)  # half-written artifacts: this user's only
        _sweep_staging(base)
        folder = Path(tempfile.mkdtemp(prefix=owned_prefix("step"), dir=base))
        try:
            yield folder
        finally:
            shutil.rmtree(folder, ignore_errors=True)

    def commit(self, staged: Path, manifest: Manifest, index_above: int | None = None,
               published: Sequence[FileEntry] = ()) -> Manifest:
        """Record file checksums in the manifest and publish the artifact atomically (manifest last). A top-level
        folder of more than `index_above` files is listed in a sidecar shard index (infra/shard_index.py).
        `published` (a remote store only): files a step's writers already put in the artifact's folder, with the
        digests they recorded; checked against the store's listing, not read again."""
        if published and not self.is_remote:
            raise ValueError("files are published in place only into a remote store's artifact folder")
        files = sorted(p for p in staged.rglob("*") if p.is_file() and p.name != MANIFEST)
        uploaded = [FileEntry(path=p.relative_to(staged).as_posix(), size=p.stat().st_size,
                              sha256=sha256_file(str(p))) for p in files]
        clash = {e.path for e in uploaded} & {e.path for e in published}
        if clash:
            raise ValueError(f"{sorted(clash)[:3]} both staged and published in place")
        entries = [*uploaded, *published]
        listed, sets = entries, []
        if index_above is not None:
            listed, large = shard_index.split_large_folders(entries, index_above)
            for folder, members in large.items():
                body = shard_index.encode(members)
                (staged / shard_index.index_name(folder)).write_bytes(body)
                sets.append(shard_index.shard_set(folder, members, body))
                listed.append(FileEntry(path=sets[-1].index, size=len(body), sha256=sets[-1].sha256))
                uploaded.append(listed[-1])
        listed.sort(key=lambda e: e.path)
        manifest = manifest.model_copy(update={"files": listed, "shard_sets": sets})
        if manifest.resources is not None:  # what the commit itself writes and sends
            sent = sum(e.size for e in entries) if self.is_remote else 0
            manifest = manifest.model_copy(update={"resources": manifest.resources.model_copy(update={
                "written": manifest.total_bytes, "uploaded": manifest.resources.uploaded + sent})})
        body = manifest.model_dump_json(indent=2)
        self._mark()
        target = self.path_of(manifest.uri)
        if self.is_remote:
            self._upload(staged, uploaded, target, body, published)
        else:
            self._move_into_place(staged, Path(target), body)
        return manifest

    def shard_members(self, manifest: Manifest, folder: str | None = None, cached: bool = True) -> list[FileEntry]:
        """The files of the artifact's shard sets (of the one for `folder` alone, when given), read from their
        indexes and checked against the manifest; DamagedManifest when an index is not the committed one.
        `cached`: an index this store read before is not read again (a check of the artifact reads it afresh)."""
        members: list[FileEntry] = []
        for shards in manifest.shard_sets:
            if folder is None or shards.folder == folder:
                key = (manifest.uri, shards.sha256)
                if key not in self._indexes or not cached:
                    try:
                        body = self.read_bytes(manifest.uri, shards.index)
                    except FileNotFoundError:
                        raise DamagedManifest(f"{manifest.uri}/{shards.index}: the shard index is missing") from None
                    if len(self._indexes) >= INDEXES_KEPT:  # a million entries each: keep the last few read
                        self._indexes.pop(next(iter(self._indexes)))
                    self._indexes[key] = shard_index.decode(body, shards, manifest.uri)
                members += self._indexes[key]
        return members

    def entries(self, manifest: Manifest, under: str | None = None) -> list[FileEntry]:
        """Every file of the artifact (under the sub-folder `under`, when given), shard sets included, in path
        order."""
        prefix = under.strip("/") + "/" if under else ""
        listed = [e for e in manifest.files if e.path.startswith(prefix)]
        top = prefix.split("/", 1)[0] if prefix else None
        return sorted(listed + [e for e in self.shard_members(manifest, top) if e.path.startswith(prefix)],
                      key=lambda e: e.path)

    def _move_into_place(self, staged: Path, target: Path, body: str) -> None:
        (staged / MANIFEST).write_text(body)
        inside_folder(Path(self.root), target.parent, "the artifacts of one kind")
        target.parent.mkdir(parents=True, exist_ok=True)
        if target.exists():
            if (target / MANIFEST).exists():
                return  # already committed by an earlier attempt: artifacts are immutable
            shutil.rmtree(target)  # leftovers of a crashed commit
        moved = staged.with_name(staged.name + ".moving")
        staged.rename(moved)  # keep `staging()`'s cleanup from touching the published folder
        os.replace(moved, target)
        os.makedirs(staged, exist_ok=True)

    def _upload(self, staged: Path, entries: list[FileEntry], target: str, body: str,
                published: Sequence[FileEntry]) -> None:
        if self.fs.exists(f"{target}/{MANIFEST}"):
            return
        if published:
            self._check_published(target, published, {e.path for e in entries})
        for entry in entries:
            self.fs.put_file(str(staged / entry.path), f"{target}/{entry.path}")
        with self.fs.open(f"{target}/{MANIFEST}", "w") as f:
            f.write(body)

    def _check_published(self, target: str, published: Sequence[FileEntry], staged: set[str]) -> None:
        """Every published file is in the artifact's folder at its recorded size (an upload that never finished
        is missing), and the folders they were written to hold nothing else: a shard left there by an earlier
        attempt that read the source in other groups is removed, so a reader listing the folder finds only what
        the manifest lists."""
        self.fs.invalidate_cache(target)
        sizes = {path[len(target) + 1:]: int(info["size"])
                 for path, info in self.fs.find(target, detail=True).items()}
        wrong = [f"{e.path} ({f'{sizes[e.path]:,} bytes' if e.path in sizes else 'missing'}, its writer recorded "
                 f"{e.size:,})" for e in published if sizes.get(e.path) != e.size]
        if wrong:
            raise OSError(f"{self.root}: files a step wrote into {target} are not as recorded: {'; '.join(wrong[:3])}"
                          f"{f' and {len(wrong) - 3} more' if len(wrong) > 3 else ''}; remove the step's work "
                          "folder and run it again")
        folders = {e.path.split("/", 1)[0] for e in published if "/" in e.path}
        expected = staged | {e.path for e in published}
        stale = [f"{target}/{path}" for path in sizes
                 if "/" in path and path.split("/", 1)[0] in folders and path not in expected]
        if stale:
            self.fs.rm(stale)
