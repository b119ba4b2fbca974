"""A committed file read straight from the store, checked as it streams: its sha256 and size are compared with the
manifest's when the reader reaches the end, and a difference raises there, before anything built from the file
can be committed. A reader that stops early (a sample) has only the store listing's size check behind it."""

from __future__ import annotations

import hashlib
import io
from typing import BinaryIO

from compass.infra.manifest import FileEntry


class ChangedSinceCommit(OSError):
    """A store file whose bytes are not the ones its manifest recorded."""


class HashingReader(io.RawIOBase):
    def __init__(self, stream: BinaryIO, entry: FileEntry, where: str):
        self.stream, self.entry, self.where = stream, entry, where
        self.digest, self.size, self.checked = hashlib.sha256(), 0, False

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        data = self.stream.read(len(buffer))
        n = len(data)
        buffer[:n] = data
        self.digest.update(data)
        self.size += n
        if n == 0 and not self.checked:
            self._check()
        return n

    def _check(self) -> None:
        self.checked = True
        if self.size != self.entry.size or self.digest.hexdigest() != self.entry.sha256:
            raise ChangedSinceCommit(f"{self.where}: {self.size:,} bytes read, sha256 {self.digest.hexdigest()[:12]}; "
                                     f"committed as {self.entry.size:,} bytes, {self.entry.sha256[:12]} (the store's "
                                     "file differs from its manifest: `compass verify` the store)")

    def close(self) -> None:
        self.stream.close()
        super().close()


def verified(stream: BinaryIO, entry: FileEntry, where: str) -> BinaryIO:
    """`stream`, buffered, hashed as it is read and checked at its end."""
    return io.BufferedReader(HashingReader(stream, entry, where), buffer_size=1 << 20)
