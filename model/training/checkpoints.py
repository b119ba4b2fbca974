"""Checkpoints: written into a temporary folder, checksummed, then renamed into place (the checksum file is
the commit marker); verified on load; keep-last-K plus stage ends.

Writing happens in the background: the training thread copies the state to host memory (a snapshot) and goes
on; a writer thread serialises it. At most one write is in flight, and a checkpoint exists for resume only once
its checksum file is in place after the rename, so a process killed mid-write leaves a `.tmp` folder that
nothing takes for a checkpoint.
"""

from __future__ import annotations

import copy
import json
import logging
import random
import shutil
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from compass.infra import layout
from compass.infra.fingerprint import sha256_file
from compass.infra.layout import CHECKSUMS, CheckpointFolder, checkpoint_name

log = logging.getLogger("compass.train")


class CheckpointCorrupt(RuntimeError):
    pass


def step_dir(root: Path, step: int) -> Path:
    return root / checkpoint_name(step)


def rng_state() -> dict[str, Any]:
    """Every random generator training draws from: Python, NumPy, torch's CPU and each CUDA device's."""
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def seed_rngs(seed: int) -> None:
    """Start Python's and NumPy's global generators from the run's seed (torch's is seeded where the model is
    built). Left alone, each process seeds them from the OS: a checkpoint of a resumed run would then hold other
    generator states than the same checkpoint of an uninterrupted run, though neither drew from them."""
    random.seed(seed)
    np.random.seed(seed % 2**32)


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def to_host(obj: Any) -> Any:
    """A copy of a (nested) state with every tensor copied to CPU memory: training may go on changing the
    originals while the copy is written."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        items = [(k, to_host(v)) for k, v in obj.items()]
        return OrderedDict(items) if isinstance(obj, OrderedDict) else dict(items)
    if isinstance(obj, list | tuple) and not hasattr(obj, "_fields"):
        return type(obj)(to_host(v) for v in obj)
    return copy.deepcopy(obj)


class HostStaging:
    """A state copied to host memory for the writer thread, into buffers kept from one checkpoint to the next:
    torch's DefaultStager keeps one host storage per storage it copied (pinned on CUDA, the copy non-blocking), so
    host memory holds one copy of the weights and both Adam moments however many checkpoints a stage writes (a new
    copy per checkpoint left each to the allocator). A buffer is overwritten at the next checkpoint only: the trainer
    lets the previous write finish first (`Trainer.save_checkpoint` settles it)."""

    def __init__(self, cuda: bool):
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        self.stager = DefaultStager(StagingOptions(use_pinned_memory=cuda, use_shared_memory=False,
                                                   use_async_staging=False, use_non_blocking_copy=cuda))

    def copy(self, state: Any) -> Any:
        return self.stager.stage(state)


Write = Callable[[Path], list[Path]]  # writes some files of a checkpoint into the folder it is given; returns them


class CheckpointWriter:
    """Writes checkpoints on a background thread, one at a time. `submit` first waits for the previous write
    (that wait is the time training is blocked), then returns while the new one is written; `wait` blocks until
    everything submitted is on disk (and raises what a write raised)."""

    def __init__(self, background: bool = True):
        self.background = background
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def submit(self, writes: list[Write], folder: Path, then: Callable[[list[Path]], None] | None = None) -> float:
        """Run `writes` into `folder`, then `then(files written)` (e.g. the commit); returns the seconds spent
        blocked."""
        blocked = self.wait()
        if not self.background:
            start = time.perf_counter()
            self._run(writes, folder, then)
            self._raise()
            return blocked + time.perf_counter() - start
        self._thread = threading.Thread(target=self._run, args=(writes, folder, then), name="compass-checkpoint",
                                        daemon=True)
        self._thread.start()
        return blocked

    def _run(self, writes: list[Write], folder: Path, then: Callable[[list[Path]], None] | None) -> None:
        try:
            written = [path for write in writes for path in write(folder)]
            if then is not None:
                then(written)
        except BaseException as exc:  # surfaced in the training thread by the next wait()
            self._error = exc

    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def wait(self) -> float:
        start = time.perf_counter()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self._raise()
        return time.perf_counter() - start

    def _raise(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            raise RuntimeError(f"writing a checkpoint failed: {error}") from error


def stamps(folder: Path, files: list[Path]) -> dict[str, dict[str, Any]]:
    """Size and sha256 of each file, keyed by its path in `folder`: what the checksum file records."""
    return {p.relative_to(folder).as_posix(): {"size": p.stat().st_size, "sha256": sha256_file(str(p))}
            for p in files}


def finalize(tmp: Path, final: Path, sums: dict[str, dict[str, Any]] | None = None) -> Path:
    """Write the checksum file last (`sums`, completed with any file they miss) and rename the folder into
    place."""
    sums = dict(sums or {})
    files = sorted(p for p in tmp.rglob("*") if p.is_file())
    sums |= stamps(tmp, [p for p in files if p.relative_to(tmp).as_posix() not in sums])
    (tmp / CHECKSUMS).write_text(json.dumps(dict(sorted(sums.items())), indent=1))
    if final.exists():
        shutil.rmtree(final)
    tmp.rename(final)
    return final


WRITTEN = ".written-rank{}"


def commit_when_all_written(tmp: Path, final: Path, rank: int, world: int,
                            timeout_s: float = 3600.0) -> Callable[[list[Path]], None]:
    """What the writer runs after this rank's files: each rank stamps the files it wrote itself (the ranks hash
    the checkpoint in parallel, each its own shards) and leaves them in a marker in the (shared) folder; rank 0
    waits for every marker, then writes the checksum file from the stamps and renames the folder. No collective
    runs off the training thread, and a checkpoint is committed only when every rank's part is on disk."""

    def mark(written: list[Path]) -> None:
        marker = tmp / WRITTEN.format(rank)
        partial = marker.with_suffix(".partial")
        partial.write_text(json.dumps(stamps(tmp, written)))
        partial.rename(marker)  # whole or absent: rank 0 waits for it to exist

    def commit(written: list[Path]) -> None:
        markers = [tmp / WRITTEN.format(r) for r in range(1, world)]
        deadline = time.monotonic() + timeout_s
        while not all(m.exists() for m in markers):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{tmp}: not every rank wrote its part within {timeout_s:.0f}s")
            time.sleep(0.05)
        sums = stamps(tmp, written)
        for marker in markers:
            sums |= json.loads(marker.read_text())
            marker.unlink()
        finalize(tmp, final, sums)

    return commit if rank == 0 else mark


def verify(folder: Path, rank: int = 0, world: int = 1) -> None:
    """Every file present at its committed size, and this rank's share of the files hashed (file i is rank
    i mod world's): the ranks of a resuming job read the checkpoint once between them, not once each."""
    sums = json.loads((folder / CHECKSUMS).read_text())
    for i, (rel, entry) in enumerate(sorted(sums.items())):
        digest, size = (entry, None) if isinstance(entry, str) else (entry["sha256"], entry["size"])
        path = folder / rel
        if not path.exists() or (size is not None and path.stat().st_size != size):
            raise CheckpointCorrupt(f"{path} is missing or not the size it was committed at")
        if i % world == rank and sha256_file(str(path)) != digest:
            raise CheckpointCorrupt(f"{path} does not match its checksum")


def complete_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoints, oldest first (incomplete temporary folders are ignored)."""
    return [c.root for c in layout.complete_checkpoints(root)]


def newest_valid(root: Path, rank: int = 0, world: int = 1,
                 agree: Callable[[bool], bool] = lambda bad: bad) -> Path | None:
    """The newest checkpoint that verifies; a corrupt one is set aside (by rank 0) and the next older one tried.
    Each rank verifies its share; `agree` tells every rank whether any found its share bad (a collective), so
    all ranks resume from the same checkpoint."""
    for folder in reversed(complete_checkpoints(root)):
        try:
            verify(folder, rank, world)
            bad = False
        except CheckpointCorrupt as exc:
            log.warning("%s", exc)
            bad = True
        if not agree(bad):
            return folder
        if rank == 0:
            folder.rename(folder.with_name(folder.name + ".corrupt"))
    return None


def prune(root: Path, keep_last: int, keep: set[int], pending: Path | None = None) -> None:
    """Delete complete checkpoints beyond the newest `keep_last`, except the steps in `keep` (stage ends). With
    `pending` (every checkpoint is to be evaluated), a pruned checkpoint's Hugging Face export is moved there first,
    with its checksum file: only the training state goes, and the step's artifact keeps the export for evaluation."""
    if pending is not None:
        _finish_pending_moves(pending)
    done = complete_checkpoints(root)
    for folder in done[:-keep_last] if keep_last else done:
        if CheckpointFolder(folder).step not in keep:
            if pending is not None:
                _keep_export(CheckpointFolder(folder), pending)
            shutil.rmtree(folder)
    for leftover in root.glob("*.tmp"):
        shutil.rmtree(leftover, ignore_errors=True)


def _keep_export(folder: CheckpointFolder, pending: Path) -> None:
    """Move the export to `pending/<name>` (renames on one file system, no copy): the checksum file is copied into
    a `.tmp` folder, the export renamed into it, the folder renamed into place. A kill between two renames leaves
    either the export where it was (done again at the next prune) or a `.tmp` holding both (finished then)."""
    if not folder.exported:
        return
    target = pending / folder.root.name
    if target.exists():  # moved by an attempt killed before it deleted the checkpoint
        return
    tmp = pending / f"{folder.root.name}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    shutil.copy2(folder.checksums, tmp / folder.checksums.name)
    folder.hf.rename(tmp / folder.hf.name)
    tmp.rename(target)


def _finish_pending_moves(pending: Path) -> None:
    """A `.tmp` move a kill interrupted: renamed into place when it holds the export, else dropped (the export is
    still in its checkpoint)."""
    for tmp in pending.glob("*.tmp") if pending.is_dir() else []:
        moved = CheckpointFolder(tmp.with_suffix(""))
        if (tmp / moved.weights).exists() and (tmp / moved.checksums.name).exists() and not moved.root.exists():
            tmp.rename(moved.root)
        else:
            shutil.rmtree(tmp, ignore_errors=True)
