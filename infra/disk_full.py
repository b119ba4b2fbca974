"""What a full disk looks like to whoever met it, and how a rank that met one tells the step that launched it.

Writers report a full disk in many ways: Python's own writes raise OSError(ENOSPC); shutil.copytree gathers each
file's OSError into one shutil.Error, as text; a Rust library raises its own exception naming only the OS error
("... (os error 28)", safetensors); torch's zip writer names none at all ("[enforce fail at inline_container.cc]
unexpected pos ..."), so for a failure that names nothing the disk it happened on is looked at. A rank that meets
one writes why into its work folder's `disk-full/` (one file per rank, as infra/exits.py's `retriable/`), and the
step raises the full disk's OSError instead of "the ranks ended without their result": it becomes the one DiskFull
message (tasks/steps/execution.py) and is not retried at once.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from compass.infra.errors import DiskFull
from compass.infra.layout import WorkFolder

# what a full disk, a file past the size limit (`ulimit -f`) and an exhausted quota look like to a writer
FULL = {errno.ENOSPC: "no space left on the device of", errno.EFBIG: "a file past this process's size limit at",
        errno.EDQUOT: "the disk quota exhausted at"}
RUST_OS_ERROR = re.compile(r"\(os error (\d+)\)")  # a Rust library's io::Error as it prints (safetensors, tokenizers)
NEARLY_FULL_BYTES = 16 * 2**20  # a failed write on a disk with less free than this: the disk is why


@dataclass(frozen=True)
class FullDisk:
    """The error a full disk gave, and the path it was met at when the writer said."""

    code: int
    path: str | None

    def error(self, where: Path) -> OSError:
        return OSError(self.code, os.strerror(self.code), self.path or str(where))


def full_disk_of(exc: BaseException) -> FullDisk | None:
    """The full disk behind `exc` or what it was raised from (a checkpoint writer re-raises the write's error as
    its cause), else None."""
    seen: set[int] = set()
    at: BaseException | None = exc
    while at is not None and id(at) not in seen:
        seen.add(id(at))
        if (found := _named_in(at)) is not None:
            return found
        at = at.__cause__ or at.__context__
    return None


def _named_in(exc: BaseException) -> FullDisk | None:
    if not isinstance(exc, OSError):
        found = RUST_OS_ERROR.search(str(exc))
        return FullDisk(int(found.group(1)), None) if found and int(found.group(1)) in FULL else None
    if exc.errno in FULL:
        return FullDisk(exc.errno, exc.filename)
    if isinstance(exc, shutil.Error) and exc.args and isinstance(exc.args[0], list):
        for entry in exc.args[0]:
            if len(entry) == 3 and (found := re.match(r"\[Errno (\d+)\]", str(entry[2]))) \
                    and int(found.group(1)) in FULL:
                return FullDisk(int(found.group(1)), str(entry[1]))
    return None


def nearly_full(where: Path) -> bool:
    """Whether the disk holding `where` (or its nearest existing parent) has almost nothing left."""
    probe = next((p for p in [where, *where.parents] if p.exists()), Path("/"))
    return shutil.disk_usage(probe).free < NEARLY_FULL_BYTES


def full_disk_met(exc: BaseException, where: Path) -> FullDisk | None:
    """The full disk `exc` says it met, or, when it names none (torch's zip writer), ENOSPC at `where` if the disk
    there is (nearly) full: a failure while writing there then has the disk to blame."""
    if (found := full_disk_of(exc)) is not None:
        return found
    return FullDisk(errno.ENOSPC, str(where)) if isinstance(exc, Exception) and nearly_full(where) else None


def _notes(workdir: Path) -> Path:

    return WorkFolder(workdir).disk_full


def note_full_disk(workdir: Path, who: str, full: FullDisk) -> None:
    """Word from a rank (`rank-N`) or a step's job (`step`) that it ended on a full disk. A few bytes, which a disk
    full to the last byte may refuse too: then whoever reads finds the disk full itself (`ended_on_a_full_disk`)."""
    folder = _notes(workdir)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        (folder / who).write_text(json.dumps({"code": full.code, "path": full.path}))
    except OSError:
        pass


def full_disk_noted(workdir: Path) -> FullDisk | None:
    """The full disk a rank or the step's job noted, if one did."""
    folder = _notes(workdir)
    for note in sorted(folder.iterdir()) if folder.exists() else []:
        with open(note) as held:
            found = json.load(held)
        return FullDisk(int(found["code"]), found["path"])
    return None


def clear_full_disk_notes(workdir: Path) -> None:
    """Before ranks (or a step's job) start: what an earlier attempt noted is not theirs."""
    folder = _notes(workdir)
    for note in folder.iterdir() if folder.exists() else []:
        note.unlink(missing_ok=True)


def ended_on_a_full_disk(workdir: Path) -> None:
    """Raise the full disk's OSError when the ranks or job that just ended without their result did so on a full
    disk: one of them said so, or the disk of their work folder is full now. It becomes the one DiskFull message
    (tasks/steps/execution.py), not retried at once."""
    full = full_disk_noted(workdir) or (FullDisk(errno.ENOSPC, None) if nearly_full(workdir) else None)
    if full is not None:
        raise full.error(workdir)


@contextmanager
def disk_full_named(step_id: str, where: Path) -> Iterator[None]:
    """A full disk met within becomes the one DiskFull message: the step, the path, the space free there, what to
    do; any other error passes as it is."""
    try:
        yield
    except Exception as exc:
        if (full := full_disk_met(exc, where)) is None:
            raise
        code, path = full.code, Path(full.path) if full.path else where
        probe = next((p for p in [path, *path.parents] if p.exists()), Path("/"))
        free = shutil.disk_usage(probe).free
        raise DiskFull(code, f"{step_id}: {FULL[code]} {path} ({free / 2**20:,.0f} MiB free there): free "
                       "space (or raise the limit: ulimit -f, the quota), or move how.storage.root (and TMPDIR for S3 "
                       "stores) to a larger disk; the step resumes from its last checkpoint") from None
