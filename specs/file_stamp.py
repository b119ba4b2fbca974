"""Stamps of the files a spec names outside the store, taken when the spec loads: what enters a step's identity in
their place, so that an edited, added, removed or renamed file runs the steps that read it again, and an untouched
one keeps their artifacts.

A local stamp digests each selected file's path under the named folder and size with its modification time
(`how.storage.input_stamps: listing`, cheap: one stat per file) or its sha256 (`content`: a touched file with the
same bytes keeps its stamp; each file is hashed again only when its size, mtime or inode changed, remembered in
COMPASS_CACHE/stamps). An s3:// prefix is stamped by its objects' keys, sizes and ETags; a Hugging Face cache
snapshot by the commit its revision resolves to and the snapshot's files."""

from __future__ import annotations

import contextlib
import fnmatch
import hashlib
import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Literal

from pydantic import Field, NonNegativeInt

from compass.specs.base import SpecModel

StampMethod = Literal["listing", "content"]
Row = tuple[str, int, int | str]  # path under the root, size, mtime in ns (listing) or sha256 (content)


class FileStamp(SpecModel):
    """What compass read of a path the spec names (never written by hand): part of the identity of every step
    that reads it."""

    location: str = Field(description="The path or URI as the spec names it.")
    method: Literal["listing", "content", "etag", "snapshot"] = Field(
        description="listing: paths, sizes and modification times; content: paths, sizes and sha256; etag: an "
                    "s3:// prefix's keys, sizes and ETags; snapshot: a hub cache snapshot's commit and files.")
    files: NonNegativeInt = Field(description="Files the stamp covers.")
    bytes: NonNegativeInt = Field(description="Their total size.")
    digest: str = Field(description="sha256 over the stamp's rows.")

    def line(self) -> str:
        """`data/sft: 3 files, 12,345 bytes (listing 1a2b3c4d5e6f)`, for lineage and `why`."""
        return (f"{self.location}: {self.files:,} file{'s' if self.files != 1 else ''}, {self.bytes:,} bytes "
                f"({self.method} {self.digest[:12]})")


def _digest(rows: Iterable[object]) -> str:
    return hashlib.sha256(json.dumps(sorted(rows), default=str).encode()).hexdigest()


def local_rows(root: Path, files: dict[str, Path] | None = None, pattern: str = "*",
               method: StampMethod = "listing") -> list[Row]:
    """(path under `root`, size, mtime or sha256) of `files` (path under `root` -> file), by default every file
    under `root` whose path matches `pattern` (fnmatch: `*.jsonl` at any depth), links followed; `root` may be one
    file (its name is its path)."""
    root = root.resolve()
    if files is None:
        files = _walk(root, pattern)
    if method == "listing":
        rows = []
        for rel, path in files.items():
            with contextlib.suppress(OSError):  # gone between the listing and the stat: not part of the folder now
                st = path.stat()
                rows.append((rel, st.st_size, st.st_mtime_ns))
        return sorted(rows)
    return sorted(_ContentHashes(root).rows(files))


def _walk(root: Path, pattern: str) -> dict[str, Path]:
    if root.is_file():
        return {root.name: root}
    found = {}
    for dirpath, _, names in os.walk(root, followlinks=True):
        for name in names:
            path = Path(dirpath) / name
            rel = path.relative_to(root).as_posix()
            if fnmatch.fnmatch(rel, pattern) and path.is_file():
                found[rel] = path
    return found


def stamp_local(path: Path, location: str, method: StampMethod = "listing", pattern: str = "*") -> FileStamp | None:
    """The stamp of a local file or folder (its files whose path matches `pattern`), or None when it does not
    exist (the machine checks name it)."""
    if not path.exists():
        return None
    rows = local_rows(path, pattern=pattern, method=method)
    return FileStamp(location=location, method=method, files=len(rows), bytes=sum(r[1] for r in rows),
                     digest=_digest(rows))


def listing_digest(folder: Path, include: list[str], exclude: list[str], method: StampMethod = "listing") -> str:
    """A local source's `listing`: the digest over the files its include patterns select (fsspec's glob, as ingest
    reads them) and its exclude patterns leave."""
    import fsspec

    fs = fsspec.filesystem("file")
    root = str(folder.resolve())
    files = {}
    for pattern in include:
        for path in fs.glob(f"{root}/{pattern}"):
            rel = path[len(root) + 1:]
            if not any(fnmatch.fnmatch(rel, ex) for ex in exclude) and os.path.isfile(path):
                files[rel] = Path(path)
    return _digest(local_rows(folder, files, method=method))


def stamp_s3(uri: str) -> FileStamp:
    """The stamp of every object at or under an s3:// URI (keys, sizes, ETags: content-derived, so a re-upload of
    the same bytes keeps it). Raises OSError when the prefix cannot be listed."""
    import fsspec

    fs, root = fsspec.core.url_to_fs(uri)
    root = root.rstrip("/")
    fs.invalidate_cache(root)
    found = {p: i for p, i in fs.find(root, detail=True).items() if i.get("type", "file") != "directory"}
    rows = [(p[len(root):].lstrip("/") or Path(p).name, int(i.get("size") or 0),
             str(i.get("ETag") or i.get("etag") or i.get("LastModified") or "")) for p, i in found.items()]
    return FileStamp(location=uri, method="etag", files=len(rows), bytes=sum(r[1] for r in rows),
                     digest=_digest(rows))


def hub_snapshot_folder(cache: Path, repo: str, revision: str, repo_type: str = "model") -> Path | None:
    """The snapshot folder a revision of a cached repository resolves to (refs/<revision>, or the commit itself),
    read from the cache's own files: no hub client, no network."""
    folder = cache / f"{repo_type}s--{repo.replace('/', '--')}"
    ref = folder / "refs" / revision
    commit = ref.read_text().strip() if ref.is_file() else revision
    snapshot = folder / "snapshots" / commit
    return snapshot if snapshot.is_dir() else None


def stamp_hub_snapshot(cache: Path, repo: str, revision: str, repo_type: str = "model") -> FileStamp | None:
    """The stamp of a cached snapshot: its commit and its files' names and sizes (None when it is not cached: the
    machine checks say how to bring it)."""
    snapshot = hub_snapshot_folder(cache, repo, revision, repo_type)
    if snapshot is None:
        return None
    rows = [(rel, size, "") for rel, size, _ in local_rows(snapshot)]
    return FileStamp(location=f"{repo}@{revision}", method="snapshot", files=len(rows),
                     bytes=sum(r[1] for r in rows), digest=_digest([("commit", snapshot.name, ""), *rows]))


class _ContentHashes:
    """sha256 of a root's files, each hashed again only when its size, mtime or inode changed since it was last
    hashed here: content stamps of a large folder cost a stat per file on every load, not a read."""

    def __init__(self, root: Path):
        cache = Path(os.environ.get("COMPASS_CACHE", Path.home() / ".cache" / "compass")) / "stamps"
        self.path = cache / f"{hashlib.sha256(str(root).encode()).hexdigest()[:24]}.json"

    def _known(self) -> dict[str, list]:
        try:
            known = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {}
        return known if isinstance(known, dict) else {}

    def rows(self, files: dict[str, Path]) -> list[Row]:
        known, fresh, rows = self._known(), {}, []
        for rel, path in files.items():
            try:
                st = path.stat()
            except OSError:
                continue
            key = [st.st_size, st.st_mtime_ns, st.st_ino]
            entry = known.get(rel)
            sha = entry[3] if isinstance(entry, list) and len(entry) == 4 and entry[:3] == key else _sha256(path)
            fresh[rel] = [*key, sha]
            rows.append((rel, st.st_size, sha))
        if fresh != known:
            with contextlib.suppress(OSError):  # a cache that cannot be written only costs a hash next time
                self.path.parent.mkdir(parents=True, exist_ok=True)
                partial = self.path.with_name(f"{self.path.name}.{os.getpid()}.tmp")
                partial.write_text(json.dumps(fresh))
                partial.replace(self.path)
        return rows


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


def hub_cache() -> Path:
    """The Hugging Face hub cache as the environment names it now (huggingface_hub reads it once, at import)."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"])
    home = os.environ.get("HF_HOME") or Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "huggingface"
    return Path(home) / "hub"


def s3_credentials_here() -> bool:
    """Whether the AWS credential chain finds credentials here: the environment, profiles and files, web identity
    and container roles at once; else botocore's whole chain, which ends with the instance role of the metadata
    service (one try of a second; none where AWS_EC2_METADATA_DISABLED is set)."""
    keys = ("AWS_ACCESS_KEY_ID", "AWS_PROFILE", "AWS_WEB_IDENTITY_TOKEN_FILE", "AWS_CONTAINER_CREDENTIALS_FULL_URI",
            "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI")
    files = [Path(os.environ.get("AWS_SHARED_CREDENTIALS_FILE", Path.home() / ".aws" / "credentials")),
             Path(os.environ.get("AWS_CONFIG_FILE", Path.home() / ".aws" / "config"))]
    if any(os.environ.get(k) for k in keys) or any(f.exists() for f in files):
        return True
    import botocore.exceptions
    import botocore.session

    session = botocore.session.get_session()
    session.set_config_variable("metadata_service_timeout", 1)
    session.set_config_variable("metadata_service_num_attempts", 1)
    try:
        return session.get_credentials() is not None
    except botocore.exceptions.BotoCoreError:
        return False
