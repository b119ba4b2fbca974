"""A step's resource ledger: what it read, copied to local disk, wrote and uploaded, what it listed, the Slurm jobs it
ran and the Prefect artifacts it published, and the orchestrating process's memory and CPU while it ran. Counted
where the I/O happens (the store's reads, copies and commits; staging in the ranks; the live publisher), never
estimated, and recorded in the step's manifest beside the goodput ledger, so a cost that grows with the corpus or
the run's length shows in every run at any size.

The step's thread holds its ledger in a context variable (`counting`): the store counts into it whatever thread of
the step asks. A rank process (node-local staging runs in the trainer) counts into a ledger of its own and leaves
it as a part file in the step's work folder, which the step merges before it commits.
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import os
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

PARTS = "resources"  # the work folder's folder of the ranks' part files
TABLE = "resources"  # the table artifact of a step's ledger, in the UI and summed by `compass status`


class Resources(BaseModel):
    """The ledger as the manifest records it (sizes in bytes)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    read: int = 0  # handed to the step from its inputs: what it can read of them (a folder, a file, a stream)
    read_by_input: dict[str, int] = Field(default_factory=dict)  # "<role>/<folder>" -> bytes
    copied: int = 0  # downloaded or staged onto local disk (node-local staging, a copy of a remote artifact)
    copied_by_node: dict[str, int] = Field(default_factory=dict)
    written: int = 0  # the artifact's bytes
    uploaded: int = 0  # to a remote store (the artifact's upload, checkpoint mirror parts)
    files_listed: int = 0  # directory entries and objects listed
    slurm_jobs: int = 0
    slurm_wall_s: float = 0.0
    slurm_limit_s: float | None = None  # the longest time limit among them (None: none asked)
    artifacts_published: int = 0  # Prefect artifacts created or updated (progress, plots, tables)
    # the process that computed the step (the orchestrator, in-process; the job's, under Slurm): its peak memory
    # while the step ran, and the CPU time of the threads that worked for the step there
    peak_rss_mb: float = 0.0
    cpu_s: float = 0.0

    def row(self) -> dict[str, float | int | None]:
        """The totals as one row of a table artifact (the per-input and per-node splits stay in the manifest)."""
        return self.model_dump(exclude={"read_by_input", "copied_by_node"})

    def line(self) -> str:
        """The counters a person reads first, in one line: the bytes each way, the Slurm jobs against their limit,
        the artifacts published, the computing process's peak memory and CPU."""
        jobs = ""
        if self.slurm_jobs:
            limit = f" (longest limit {_duration(self.slurm_limit_s)})" if self.slurm_limit_s else ""
            jobs = f", {self.slurm_jobs} Slurm job{'s' * (self.slurm_jobs != 1)} {_duration(self.slurm_wall_s)}{limit}"
        return (f"read {size_text(self.read)}, copied to local disk {size_text(self.copied)}, "
                f"wrote {size_text(self.written)}, uploaded {size_text(self.uploaded)}, "
                f"{self.files_listed:,} entries listed{jobs}, "
                f"{self.artifacts_published} Prefect artifacts, peak {self.peak_rss_mb:,.0f} MiB, "
                f"{self.cpu_s:,.1f} s CPU")

    def merged(self, other: Resources) -> Resources:
        """Two ledgers of one step summed (a rank's part into the step's); peaks take the larger."""
        def add(a: dict[str, int], b: dict[str, int]) -> dict[str, int]:
            return {k: a.get(k, 0) + b.get(k, 0) for k in a.keys() | b.keys()}

        limits = [x for x in (self.slurm_limit_s, other.slurm_limit_s) if x is not None]
        return Resources(read=self.read + other.read, read_by_input=add(self.read_by_input, other.read_by_input),
                         copied=self.copied + other.copied,
                         copied_by_node=add(self.copied_by_node, other.copied_by_node),
                         written=self.written + other.written, uploaded=self.uploaded + other.uploaded,
                         files_listed=self.files_listed + other.files_listed,
                         slurm_jobs=self.slurm_jobs + other.slurm_jobs,
                         slurm_wall_s=self.slurm_wall_s + other.slurm_wall_s,
                         slurm_limit_s=max(limits) if limits else None,
                         artifacts_published=self.artifacts_published + other.artifacts_published,
                         peak_rss_mb=max(self.peak_rss_mb, other.peak_rss_mb), cpu_s=self.cpu_s + other.cpu_s)


class Ledger:
    """The counters of one step while it runs (thread-safe: a step's threads count into one ledger)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._totals = Resources()

    def add(self, **counts: object) -> None:
        """Add to the counters by field name (a dict field: {key: bytes} added key by key)."""
        with self._lock:
            self._totals = self._totals.merged(Resources.model_validate(counts))

    def read(self, role: str, folder: str, size: int) -> None:
        self.add(read=size, read_by_input={f"{role}/{folder}": size})

    def copied(self, size: int, node: str | None = None) -> None:
        self.add(copied=size, copied_by_node={node or socket.gethostname(): size})

    def snapshot(self) -> Resources:
        with self._lock:
            return self._totals

    def write_part(self, workdir: Path, who: str) -> None:
        """This process's counters as a part file of the step's work folder (a rank's), replaced whole."""
        folder = workdir / PARTS
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"{who}.json"
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(self.snapshot().model_dump_json())
        tmp.replace(path)


def size_text(n: float) -> str:
    """Bytes as a person reads them (binary units)."""
    for unit, factor in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= factor:
            return f"{n / factor:.1f} {unit}"
    return f"{n:.0f} B"


def _duration(seconds: float) -> str:
    minutes = seconds / 60
    return f"{minutes / 60:.1f} h" if minutes >= 90 else f"{minutes:.1f} min" if seconds >= 60 else f"{seconds:.0f} s"


def parts(workdir: Path) -> Resources:
    """The ranks' part files of a step's work folder, summed (none: an empty ledger); a part being replaced or
    of another shape is left out, never fatal."""
    total = Resources()
    for path in sorted((workdir / PARTS).glob("*.json")) if (workdir / PARTS).is_dir() else ():
        with contextlib.suppress(OSError, ValueError):
            total = total.merged(Resources.model_validate(json.loads(path.read_text())))
    return total


_CURRENT: contextvars.ContextVar[Ledger | None] = contextvars.ContextVar("compass_resource_ledger", default=None)


def current() -> Ledger | None:
    """The ledger of the step this thread works for (None: no step counts here)."""
    return _CURRENT.get()


def count(**counts: object) -> None:
    """Add to the current step's ledger, if a step counts here."""
    ledger = _CURRENT.get()
    if ledger is not None:
        ledger.add(**counts)


def count_copied(size: int) -> None:
    """Bytes copied onto this node's disk, for the current step's ledger."""
    ledger = _CURRENT.get()
    if ledger is not None:
        ledger.copied(size)


@contextlib.contextmanager
def counting(ledger: Ledger) -> Iterator[Ledger]:
    """Within: this thread's I/O counts into `ledger`, and the process's memory is sampled into it (its peak while
    the step runs). A thread's CPU time counts through `thread_counted`."""
    token = _CURRENT.set(ledger)
    sampler = _ProcessSampler.start(ledger)
    try:
        yield ledger
    finally:
        _CURRENT.reset(token)
        sampler.stop()


class ThreadCpu:
    """The CPU time a thread spent since it was made (time.thread_time: this thread's alone, whatever the
    process's other threads do)."""

    def __init__(self) -> None:
        self.began = time.thread_time()

    def spent(self) -> float:
        return max(0.0, time.thread_time() - self.began)


class _ProcessSampler:
    """The process's resident memory, sampled every half second while a step runs, into the step's ledger as its
    peak (the process-lifetime maximum getrusage gives says nothing of one step)."""

    INTERVAL_S = 0.5

    def __init__(self, ledger: Ledger) -> None:
        self.ledger = ledger
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="compass-rss", daemon=True)

    @classmethod
    def start(cls, ledger: Ledger) -> _ProcessSampler:
        sampler = cls(ledger)
        sampler._sample()
        sampler._thread.start()
        return sampler

    def _sample(self) -> None:
        self.ledger.add(peak_rss_mb=_rss_mb())

    def _run(self) -> None:
        while not self._stop.wait(self.INTERVAL_S):
            self._sample()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._sample()


def _rss_mb() -> float:
    """This process's resident set, from /proc (no psutil import on the orchestrator's hot path)."""
    try:
        with open("/proc/self/statm") as f:
            pages = int(f.read().split()[1])
        return pages * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, ValueError, IndexError):
        return 0.0
