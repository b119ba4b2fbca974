"""What a data step's writers wrote, hashed on the way out: each rank records the path, size and sha256 of every
file it wrote in a small JSON beside its stage's logs. On a remote store the shards go straight into the artifact's
folder, and the commit takes these records instead of reading terabytes back to hash them (infra/store.py).

Module-level and importable: Slurm array tasks and pool workers unpickle the writers that use it.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from typing import IO

from datatrove.io import OutputFileManager, get_datafolder

from compass.infra.manifest import FileEntry

RECORD_SUFFIX = ".written.json"


class HashedWrite:
    """The stored bytes of one output file (after compression), counted and hashed as they are written."""

    def __init__(self, raw: IO[bytes]):
        self.raw = raw
        self.size = 0
        self._sha256 = hashlib.sha256()

    def write(self, data: bytes) -> int:
        self._sha256.update(data)
        self.size += len(data)
        return self.raw.write(data)

    def flush(self) -> None:
        self.raw.flush()

    @property
    def sha256(self) -> str:
        return self._sha256.hexdigest()


class DigestedFile:
    """An output file a writer writes (through a compressor when there is one) whose close finishes the compressed
    stream, closes the stored object (an S3 upload completes there) and reports its digest."""

    def __init__(self, raw: IO[bytes], compression: str | None, on_close: Callable[[HashedWrite], None]):
        from fsspec.compression import compr

        self._hashed = HashedWrite(raw)
        self._outer = compr[compression](self._hashed, mode="wb") if compression else self._hashed
        self._on_close = on_close
        self.closed = False

    def write(self, data: bytes) -> int:
        return self._outer.write(data)

    def flush(self) -> None:
        self._outer.flush()

    def close(self) -> None:
        if self.closed:
            return
        if self._outer is not self._hashed:
            self._outer.close()  # the stream's end (a zstd frame's); a compressor never closes the file it was given
        self._hashed.raw.close()
        self.closed = True
        self._on_close(self._hashed)


class DigestingOutputFiles(OutputFileManager):
    """datatrove's output file manager, keeping the digest of every file it closes (binary writers only)."""

    def __init__(self, fs, mode: str = "wb", compression: str | None = "infer"):
        super().__init__(fs, mode=mode, compression=compression)
        self.written: list[FileEntry] = []

    def get_file(self, filename):
        if filename not in self._output_files:
            from fsspec.core import get_compression

            compression = get_compression(filename, self.compression)
            self._output_files[filename] = DigestedFile(
                self.fs.open(filename, mode="wb"), compression,
                lambda hashed: self.written.append(FileEntry(path=filename, size=hashed.size, sha256=hashed.sha256)))
        return self._output_files[filename]


def record(folder: str, rank: int, written: list[FileEntry]) -> None:
    """A rank's written files, as `<folder>/<rank>.written.json` (replaced by a relaunch of the rank)."""
    data_folder = get_datafolder(folder)
    with data_folder.open(f"{rank:05d}{RECORD_SUFFIX}", "w") as f:
        json.dump([e.model_dump() for e in written], f)


def recorded(folder: str, under: str = "") -> list[FileEntry]:
    """Every rank's written files recorded under `folder`, their paths put under `under`, in path order."""
    data_folder = get_datafolder(folder)
    prefix = under.strip("/") + "/" if under.strip("/") else ""
    entries: dict[str, FileEntry] = {}
    if data_folder.exists(""):
        for name in data_folder.list_files(glob_pattern=f"*{RECORD_SUFFIX}"):
            with data_folder.open(name, "r") as f:
                for item in json.load(f):
                    entry = FileEntry.model_validate(item)
                    entries[prefix + entry.path] = entry.model_copy(update={"path": prefix + entry.path})
    return sorted(entries.values(), key=lambda e: e.path)
