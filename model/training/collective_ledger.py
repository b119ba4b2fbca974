"""Each rank's last collective and heartbeat, where every peer can read them: what the hang watchdog reads to name
the ranks that did not join the collective it waits in.

A collective that never completes blocks every rank that entered it, and each one's stack only shows that it
waits. Which peer is missing, and whether it is frozen (a dead node, a stopped process) or alive elsewhere (slow
data, a branch the others did not take), is what a team needs at 3 a.m. Every collective of the training group
goes through compass.model.training.collectives, which numbers them: rank r rewrites its one fixed-size record
in `folder/rank-r.ledger` (the step's work folder, on the shared root) as it enters collective n, and the
watchdog's thread beats in the same record every second, which a frozen process stops doing. A write is one
pwrite of a few hundred bytes to the page cache (no fsync), far below a collective's own cost.
"""

from __future__ import annotations

import json
import os
import threading
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

RECORD_BYTES = 512
# what the ranks of one launch share and the next launch in the same work folder does not (a resumed job's ranks
# must not read the records its killed predecessors left)
LAUNCH_ENV = ("TORCHELASTIC_RUN_ID", "SLURM_JOB_ID", "SLURM_RESTART_COUNT", "SLURM_STEP_ID", "MASTER_ADDR",
              "MASTER_PORT")
FROZEN_AFTER_S = 3.0  # three missed beats (one a second): the rank's threads do not run (stopped, or its node gone)


@dataclass(frozen=True)
class LedgerEntry:
    """Where one rank stood: the step it is in, its last collective (number, name, the step it was entered in) and
    when its threads last ran."""

    rank: int
    node: str
    launch: str = ""
    step: int = 0
    seq: int = 0
    collective: str = ""
    collective_step: int = 0
    entered: float = 0.0  # wall-clock seconds: peers on other nodes compare it
    heartbeat: float = 0.0


class CollectiveLedger:
    """This rank's record, rewritten in place."""

    def __init__(self, folder: Path, rank: int, node: str):
        folder.mkdir(parents=True, exist_ok=True)
        self.folder = folder
        self._fd = os.open(folder / f"rank-{rank}.ledger", os.O_RDWR | os.O_CREAT, 0o644)
        self._lock = threading.Lock()  # the training thread enters collectives, the watchdog's thread beats
        self.entry = LedgerEntry(rank=rank, node=node, launch=this_launch(), heartbeat=time.time())
        self._write()

    def enter(self, collective: str) -> None:
        with self._lock:
            self.entry = replace(self.entry, seq=self.entry.seq + 1, collective=collective,
                                 collective_step=self.entry.step, entered=time.time())
            self._write()

    def at_step(self, step: int) -> None:
        with self._lock:
            self.entry = replace(self.entry, step=step)
            self._write()

    def beat(self) -> None:
        with self._lock:
            self.entry = replace(self.entry, heartbeat=time.time())
            self._write()

    def _write(self) -> None:
        os.pwrite(self._fd, json.dumps(asdict(self.entry)).encode().ljust(RECORD_BYTES), 0)


def this_launch() -> str:
    return "|".join(os.environ.get(name, "") for name in LAUNCH_ENV)


def read_ledger(folder: Path, launch: str) -> dict[int, LedgerEntry]:
    """Every rank's record in `folder` written by ranks of `launch` (a record torn by a write in progress, or left
    by an earlier launch, is left out)."""
    found = {}
    for path in folder.glob("rank-*.ledger"):
        try:
            entry = LedgerEntry(**json.loads(path.read_bytes().rstrip()))
        except (OSError, ValueError, TypeError):
            continue
        if entry.launch == launch:
            found[entry.rank] = entry
    return found


def missing_peers(mine: LedgerEntry, world: int, entries: dict[int, LedgerEntry], now: float) -> str:
    """One located line: the collective this rank waits in, and each rank that has not entered it, frozen or
    alive; or that every rank entered it (the stall is then inside the collective, or in one compass does not
    issue: the engine's own), with the ranks whose threads no longer run, the likely culprits."""
    waits = (f"rank {mine.rank} on node {mine.node} waits in collective #{mine.seq} ({mine.collective}) "
             f"of step {mine.collective_step}")
    behind = []
    for rank in range(world):
        entry = entries.get(rank)
        if entry is None:
            behind.append(f"rank {rank} (no record: it never reached its first collective)")
        elif entry.seq < mine.seq:
            silent = now - entry.heartbeat
            state = (f"frozen or gone: no heartbeat for {silent:.0f} s" if silent > FROZEN_AFTER_S
                     else "alive, not joining")
            behind.append(f"rank {rank} on node {entry.node} (in step {entry.step}, last in collective #{entry.seq} "
                          f"({entry.collective}) of step {entry.collective_step}; {state})")
    if behind:
        return f"{waits}; not joined: {', '.join(behind)}"
    frozen = [f"rank {e.rank} on node {e.node} (in step {e.step}; no heartbeat for {now - e.heartbeat:.0f} s)"
              for e in sorted(entries.values(), key=lambda e: e.rank) if now - e.heartbeat > FROZEN_AFTER_S]
    stall = "every rank entered it: the stall is inside it or in a collective of the engine's own"
    return f"{waits}; {stall}" + (f"; frozen or gone: {', '.join(frozen)}" if frozen else "")
