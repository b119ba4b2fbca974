"""Committed artifacts stay what their manifests say, or they are not reused.

A cached step is only as good as its files: a shard truncated by a full disk, bytes flipped by hand or by a
bad sector, a shard replaced with other valid data. Before a committed artifact counts as cached, its files are
compared with the manifest: missing, resized, extra or changed files make it damaged; a damaged artifact is set
aside (kept for inspection, no longer committed) and its step runs again. Hashing every file every time would
cost minutes on tens of gigabytes, so each local file's hash is trusted while its (size, mtime, inode) stays the
one recorded when it was last hashed or committed, as git's index does (`how.storage.verify: stamped`);
`full` hashes every file every time, `sizes` only compares the listing and sizes (a huge store on a slow disk).
On S3 an object's ETag plays the part of (size, mtime, inode): any overwrite changes it, so under `stamped` an
object is hashed again (streamed, not copied) only when its ETag is not the one recorded at its commit or last
check; steps can then read their inputs straight from S3.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Literal

from compass.infra import shard_index
from compass.infra.fingerprint import sha256_file
from compass.infra.manifest import MANIFEST, DamagedManifest, FileEntry, Manifest
from compass.infra.store import Store, artifact_folder, inside_folder
from compass.infra.verified_read import ChangedSinceCommit

STAMPS = ".verified"  # under the store's root: one JSON per artifact, {path: [size, mtime_ns, inode] or [size, ETag]}
SET_ASIDE = ".damaged"
Depth = Literal["sizes", "stamped", "full"]


def damage(store: Store, uri: str, depth: Depth = "stamped", expects: str | None = None) -> list[str]:
    """What differs between a committed artifact's files and its manifest (empty: intact); a manifest (or a shard
    index) that cannot describe the artifact (store.checked_manifest) is the one problem. The files of shard sets
    (infra/shard_index.py) are all compared by size, and hashed all under `full`, by a fresh sample under `stamped`
    unless every file of the set still has the stamp key it had when the set was last wholly hashed: one digest
    per set is kept, not a stamp per file (a million of them would make the stamps file the large manifest the
    index avoids). `expects`: the whole fingerprint the plan computed for the artifact (its folder names only the
    first 12 characters): a manifest made for another is damage, so a step never reuses another identity's files."""
    try:
        manifest = store.read_manifest(uri)
        if expects is not None and manifest.fingerprint != expects:  # before its shard index is read
            return [f"{uri}: its manifest was made for fingerprint {manifest.fingerprint[:24]}..., not the "
                    f"{expects[:24]}... this plan computes for it (another artifact's files and manifest)"]
        members = store.shard_members(manifest, cached=False)
    except DamagedManifest as exc:
        return [str(exc)]
    to_hash = _hashed_members(manifest, members, depth)
    if store.is_remote:
        return _remote_damage(store, uri, manifest, depth, members, to_hash)
    folder = store.local_path(uri)
    stamps_file = _stamps_file(store, manifest)
    stamps = _read_stamps(stamps_file)
    keys: dict[str, list] = {}
    for entry in members:
        try:
            st = (folder / entry.path).stat()
        except FileNotFoundError:
            continue
        keys[entry.path] = [st.st_size, st.st_mtime_ns, st.st_ino]
    problems, fresh = _member_damage(manifest, members, keys, stamps, depth, to_hash,
                                     lambda entry: sha256_file(str(folder / entry.path)) == entry.sha256)
    for entry in manifest.files:
        path = folder / entry.path
        try:
            st = path.stat()
        except FileNotFoundError:
            problems.append(f"{entry.path}: missing")
            continue
        if st.st_size != entry.size:
            problems.append(f"{entry.path}: {st.st_size:,} bytes, committed with {entry.size:,}")
            continue
        key = [st.st_size, st.st_mtime_ns, st.st_ino]
        hash_it = depth == "full" or (depth == "stamped" and stamps.get(entry.path) != key)
        if hash_it and sha256_file(str(path)) != entry.sha256:
            problems.append(f"{entry.path}: contents changed since the commit (sha256 differs)")
            continue
        fresh[entry.path] = key
    listed = {e.path for e in manifest.files} | {e.path for e in members}
    files, links = _walk(folder)
    problems += [f"{rel}: not part of the committed artifact" for rel in files if rel not in listed]
    problems += [f"{rel}: a link to {os.path.realpath(folder / rel)}, not a file of the artifact"
                 for rel in links]  # what it names may change with no change to the artifact's own files
    if fresh != stamps and depth != "sizes":  # a damaged file loses its stamp: a later `stamped` check hashes it
        _write_stamps(stamps_file, fresh)
    return problems


def _member_damage(manifest: Manifest, members: list[FileEntry], keys: dict[str, list], stamps: dict[str, list],
                   depth: Depth, to_hash: set[str], intact: Callable[[FileEntry], bool]) -> tuple[list[str], dict]:
    """Problems of the shard sets' files (`keys`: each present file's stamp key, its size first) and the set stamps
    to keep. A set whose members' keys all equal those stamped when it was last wholly hashed (at its commit, or by
    a `full` check) is not sampled under `stamped`: its shards are then only listed, however large they are."""
    now = _set_stamps(manifest, keys)
    unchanged = {folder for folder, value in now.items() if stamps.get(folder) == value} if depth == "stamped" \
        else set()
    problems = []
    for entry in members:
        key = keys.get(entry.path)
        if key is None:
            problems.append(f"{entry.path}: missing")
        elif key[0] != entry.size:
            problems.append(f"{entry.path}: {key[0]:,} bytes, committed with {entry.size:,}")
        elif entry.path in to_hash and entry.path.split("/", 1)[0] + "/" not in unchanged and not intact(entry):
            problems.append(f"{entry.path}: contents changed since the commit (sha256 differs)")
    kept = now if depth == "full" and not problems else {folder: now[folder] for folder in unchanged}
    return problems, kept


def _set_stamps(manifest: Manifest, keys: dict[str, list]) -> dict[str, list]:
    """{'<folder>/': [files, digest]} per shard set: the digest of its files' (path, stamp key) pairs. A key ends
    in '/', which no file's path does."""
    stamps = {}
    for shards in manifest.shard_sets:
        prefix = f"{shards.folder}/"
        pairs = sorted((path, key) for path, key in keys.items() if path.startswith(prefix))
        stamps[prefix] = [len(pairs), hashlib.sha256(json.dumps(pairs).encode()).hexdigest()]
    return stamps


def _hashed_members(manifest: Manifest, members: list[FileEntry], depth: Depth) -> set[str]:
    """The shard-set files a check hashes: all under `full`, a random sample of each set under `stamped`."""
    if depth == "full":
        return {e.path for e in members}
    if depth == "sizes":
        return set()
    return set().union(*(shard_index.sample([e for e in members if e.path.startswith(f"{s.folder}/")])
                         for s in manifest.shard_sets))


def describe(problems: list[str]) -> str:
    """The first few problems of a damaged artifact, for one log line or error."""
    more = f"; {len(problems) - 3} more" if len(problems) > 3 else ""
    return "; ".join(problems[:3]) + more


ARTIFACT_FOLDER = re.compile(r"[^/.][^/]*/[^/]+-[0-9A-Za-z]{12}")  # <kind>/<name>-<fingerprint[:12]>


def committed(store: Store) -> list[str]:
    """Every committed artifact's URI in the store: its <kind>/<name>-<fp> folders holding a manifest, links to
    folders included (fsspec's local glob skips them), so a linked artifact is checked and found damaged. Another
    program's `*/*/manifest.json` (a web app's `public/manifest.json`) is no artifact: never checked, never set
    aside."""
    uris = []
    for path in _manifest_paths(store):
        relative = path[len(store.root_path):].strip("/").removesuffix(f"/{MANIFEST}")
        if ARTIFACT_FOLDER.fullmatch(relative):  # not staging, locks or what was set aside (dot folders)
            uris.append(f"{store.root.rstrip('/')}/{relative}")
    return sorted(uris)


def _manifest_paths(store: Store) -> list[str]:
    pattern = f"*/*/{MANIFEST}"
    if store.is_remote:
        return store.fs.glob(f"{store.root_path}/{pattern}")
    return [p.as_posix() for p in Path(store.root_path).glob(pattern)]  # pathlib follows linked folders


def stamp(store: Store, manifest: Manifest) -> None:
    """Record the files just committed (their hashes were computed for the manifest): later checks only stat
    (list, on S3)."""
    members = store.shard_members(manifest)
    if store.is_remote:
        listing = _remote_listing(store, manifest)
        stamps = {e.path: [listing[e.path][0], listing[e.path][1]] for e in manifest.files if e.path in listing}
        keys = {e.path: list(listing[e.path]) for e in members if e.path in listing}
        _write_remote_stamps(store, manifest, stamps | _set_stamps(manifest, keys))
        return
    folder = store.local_path(manifest.uri)
    stamps, keys = {}, {}
    for entries, into in ((manifest.files, stamps), (members, keys)):
        for entry in entries:
            st = (folder / entry.path).stat()
            into[entry.path] = [st.st_size, st.st_mtime_ns, st.st_ino]
    _write_stamps(_stamps_file(store, manifest), stamps | _set_stamps(manifest, keys))


def set_aside(store: Store, uri: str) -> str:
    """Make a damaged artifact uncommitted, keeping its files for inspection; returns where they went. Named by its
    URI, not its manifest, which may be the damaged part (a linked folder is moved as the link)."""
    path = store.path_of(uri)
    folder = path[len(store.root_path):].strip("/")
    suffix = time.strftime("%Y%m%d-%H%M%S") + "-" + uuid.uuid4().hex[:6]
    if store.is_remote:  # the files stay and are overwritten by the next commit; the manifest marks the damage
        store.fs.mv(f"{path}/{MANIFEST}", f"{path}/{MANIFEST}.damaged-{suffix}")
        return f"{uri.rstrip('/')}/{MANIFEST}.damaged-{suffix}"
    aside = inside_folder(Path(store.root_path), Path(store.root_path) / SET_ASIDE, "damaged artifacts set aside")
    target = aside / f"{folder}-{suffix}"
    inside_folder(Path(store.root_path), target.parent, "damaged artifacts of one kind")
    target.parent.mkdir(parents=True, exist_ok=True)
    Path(path).rename(target)
    (Path(store.root_path) / STAMPS / f"{folder}.json").unlink(missing_ok=True)
    return str(target)


def _remote_damage(store: Store, uri: str, manifest: Manifest, depth: Depth, members: list[FileEntry],
                   to_hash: set[str]) -> list[str]:
    found = _remote_listing(store, manifest)
    stamps = _read_remote_stamps(store, manifest)
    keys = {e.path: list(found[e.path]) for e in members if e.path in found}
    problems, fresh = _member_damage(manifest, members, keys, stamps, depth, to_hash,
                                     lambda entry: _streams_intact(store, uri, entry))
    for entry in manifest.files:
        if entry.path not in found:
            problems.append(f"{entry.path}: missing")
            continue
        size, etag = found[entry.path]
        if size != entry.size:
            problems.append(f"{entry.path}: {size:,} bytes, committed with {entry.size:,}")
            continue
        if (depth == "full" or (depth == "stamped" and stamps.get(entry.path) != [size, etag])) and \
                not _streams_intact(store, uri, entry):
            problems.append(f"{entry.path}: contents changed since the commit (sha256 differs)")
            continue
        fresh[entry.path] = [size, etag]
    listed = {e.path for e in manifest.files} | {e.path for e in members} | {MANIFEST}
    problems += [f"{rel}: not part of the committed artifact" for rel in sorted(found)
                 if rel not in listed and not rel.startswith(f"{MANIFEST}.damaged-")]
    if not problems and fresh != stamps and depth != "sizes":
        _write_remote_stamps(store, manifest, fresh)
    return problems


def _streams_intact(store: Store, uri: str, entry: FileEntry) -> bool:
    """Whether the object's bytes hash to the manifest's sha256 (streamed, not copied)."""
    try:
        with store.open_committed(uri, entry) as f:  # hashed as it streams, checked at its end
            while f.read(1 << 22):
                pass
    except ChangedSinceCommit:
        return False
    return True


def _remote_listing(store: Store, manifest: Manifest) -> dict[str, tuple[int, str]]:
    """{relative path: (size, ETag)} of an artifact's objects, listed afresh (not from s3fs's listing cache)."""
    root = f"{store.root_path}/{artifact_folder(manifest.kind, manifest.name, manifest.fingerprint)}"
    store.fs.invalidate_cache(root)  # the root and its parents; its sub-folders' listings (ETags) go below
    for cached in [key for key in store.fs.dircache if key.startswith(f"{root}/")]:
        store.fs.dircache.pop(cached, None)
    return {p[len(root) + 1:]: (info.get("size"), str(info.get("ETag") or info.get("etag") or ""))
            for p, info in store.fs.find(root, detail=True).items()}


def _remote_stamps_path(store: Store, manifest: Manifest) -> str:
    return f"{store.root_path}/{STAMPS}/{artifact_folder(manifest.kind, manifest.name, manifest.fingerprint)}.json"


def _read_remote_stamps(store: Store, manifest: Manifest) -> dict[str, list]:
    try:
        return json.loads(store.fs.cat_file(_remote_stamps_path(store, manifest)))
    except (FileNotFoundError, ValueError):
        return {}


def _write_remote_stamps(store: Store, manifest: Manifest, stamps: dict[str, list]) -> None:
    store.fs.pipe_file(_remote_stamps_path(store, manifest), json.dumps(stamps).encode())  # one PUT: atomic


def _walk(folder: Path) -> tuple[list[str], list[str]]:
    """The files under an artifact's folder (its manifest left out) and every symbolic link among them (a committed
    file replaced by one, or one added), in one walk."""
    files, links = [], []
    for p in folder.rglob("*"):
        rel = p.relative_to(folder).as_posix()
        if p.is_symlink():
            links.append(rel)
        if p.is_file() and p.name != MANIFEST:
            files.append(rel)
    return sorted(files), sorted(links)


def _stamps_file(store: Store, manifest: Manifest) -> Path:
    folder = artifact_folder(manifest.kind, manifest.name, manifest.fingerprint)
    return Path(store.root_path) / STAMPS / f"{folder}.json"


def _read_stamps(path: Path) -> dict[str, list]:
    """The stamps recorded for an artifact: {file or shard set: its stamp key}. A file of another shape (`[]`, a
    key that is no list, unreadable text) is no record: those files are hashed again, never a traceback."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict):
        return {}
    return {k: v for k, v in data.items() if isinstance(k, str) and isinstance(v, list)}


def _write_stamps(path: Path, stamps: dict[str, list]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f"{path.name}.{os.getpid()}.{uuid.uuid4().hex[:6]}")
    partial.write_text(json.dumps(stamps))
    partial.replace(path)  # atomic: two runs checking the same artifact never read half a file
