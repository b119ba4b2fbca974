"""The goodput ledger: where a training stage's wall time went, over every attempt (a kill, a requeue, a node lost),
as goodput (the optimizer steps the stage keeps) and badput by cause: start-up, waiting for data, checkpoint stalls,
evaluation, restarts (nobody training between two attempts) and work redone (steps computed after the checkpoint a
later attempt or a rollback went back to). What remains (logging, callbacks, the stage's end) is `other`.

Rank 0 keeps one record per attempt in the work folder (`goodput/attempt-<start>.json`, rewritten at most every
second and at each checkpoint, so a kill -9 loses at most a second of it); the split over all of them is the
stage's, in its TrainResult, its manifest's metrics and the live Prometheus gauge.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import psutil
from pydantic import BaseModel, ConfigDict

from compass.model.training.records import GoodputSplit, MetricsRow


class Sums(BaseModel):
    """Seconds summed over an attempt's steps, at one point of it (`at`: wall clock, epoch seconds)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    at: float
    data_wait_s: float = 0.0
    compute_s: float = 0.0  # forward, backward, the step's sync and the optimizer
    checkpoint_s: float = 0.0

    def after(self, row: MetricsRow, at: float) -> Sums:
        return Sums(at=at, data_wait_s=self.data_wait_s + row.seconds("data_wait"),
                    compute_s=self.compute_s + row.seconds("forward_backward") + row.seconds("sync")
                    + row.seconds("optimizer"), checkpoint_s=self.checkpoint_s + row.seconds("checkpoint"))

    def minus(self, base: Sums) -> Sums:
        return Sums(at=self.at - base.at, data_wait_s=self.data_wait_s - base.data_wait_s,
                    compute_s=self.compute_s - base.compute_s, checkpoint_s=self.checkpoint_s - base.checkpoint_s)


class Attempt(BaseModel):
    """One process's run of the stage, as rank 0 saw it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    started_at: float  # the rank's process was created (epoch seconds)
    resumed_from: int | None  # the stage step it started from (None: it never began training, killed while starting)
    first_step: Sums | None = None  # when its first step began (the sums are zero)
    now: Sums  # the sums after its last step, at its last write
    step: int  # the last stage step it completed
    marks: dict[int, Sums] = {}  # the sums at each checkpoint it wrote, by stage step
    redone_s: float = 0.0  # steps a rollback discarded
    evaluation_s: float = 0.0  # the validation after the stage's last step
    ended_at: float | None = None  # the stage's end, validated (the last attempt's)


def split(attempts: list[Attempt]) -> GoodputSplit:
    """The stage's split over its attempts, oldest first. A later attempt that resumed from step r makes the steps an
    earlier one computed after r redone work; the time between one attempt's last record and the next one's start
    is restart time."""
    ordered = sorted(attempts, key=lambda a: a.started_at)
    kept = Sums(at=0.0)
    startup = restart = redone = evaluation = 0.0
    redone_steps = 0
    for i, attempt in enumerate(ordered):
        first = attempt.first_step or attempt.now
        startup += first.at - attempt.started_at
        evaluation += attempt.evaluation_s
        redone += attempt.redone_s
        done = attempt.now
        if i + 1 < len(ordered):
            restart += max(0.0, ordered[i + 1].started_at - attempt.now.at)
            # the next attempt that began training (one killed while starting resumed nothing)
            after = next((a for a in ordered[i + 1:] if a.resumed_from is not None), None)
            if attempt.resumed_from is not None and after is not None and after.resumed_from < attempt.step:
                base = attempt.marks.get(after.resumed_from) or Sums(at=first.at)  # (or before this attempt began)
                redone += attempt.now.at - base.at  # it went back: the steps since were computed again
                redone_steps += attempt.step - after.resumed_from
                done = base
        kept = Sums(at=0.0, data_wait_s=kept.data_wait_s + done.data_wait_s, compute_s=kept.compute_s + done.compute_s,
                    checkpoint_s=kept.checkpoint_s + done.checkpoint_s)
    if not ordered:
        raise ValueError("no attempt recorded")
    last = ordered[-1]
    total = (last.ended_at or last.now.at) - ordered[0].started_at
    compute = kept.compute_s  # a rollback's discarded steps left the sums (post_restore): they are in redone_s
    named = startup + kept.data_wait_s + kept.checkpoint_s + evaluation + restart + redone + compute
    return GoodputSplit(total_s=total, compute_s=compute, startup_s=startup, data_wait_s=kept.data_wait_s,
                        checkpoint_s=kept.checkpoint_s, evaluation_s=evaluation, restart_s=restart, redone_s=redone,
                        other_s=max(0.0, total - named), attempts=len(ordered), redone_steps=redone_steps)


WRITE_EVERY_S = 1.0  # an attempt's record is rewritten at most this often (and at each checkpoint)


class AttemptFile:
    """Rank 0's record of this attempt in a goodput folder (`attempt-<start>.json`, replaced atomically): what the
    compass trainer's ledger and the TRL steps' keep."""

    def __init__(self, folder: Path, started_at: float):
        self.folder = folder
        self.started_at = started_at
        self.path = folder / f"attempt-{int(started_at * 1e6):020d}.json"
        self.attempt: Attempt | None = None  # None until training starts, and on ranks other than 0
        self.written = 0.0

    def begin(self) -> None:
        """The attempt's process is up (its libraries imported, its model built): recorded before training starts,
        so an attempt killed while it starts (a hung rendezvous, a checkpoint that will not load) still counts, its
        start-up as start-up and the time to the next attempt as restart."""
        self._write(Attempt(started_at=self.started_at, resumed_from=None, now=Sums(at=time.time()), step=0))

    def start(self, step: int) -> None:
        """Training starts (or resumes) at `step`: its first step begins now."""
        now = time.time()
        self.attempt = Attempt(started_at=self.started_at, resumed_from=step, first_step=Sums(at=now),
                               now=Sums(at=now), step=step, marks={step: Sums(at=now)})
        self.write()

    def update(self, **changes: object) -> None:
        assert self.attempt is not None
        self.attempt = self.attempt.model_copy(update=changes)

    def write(self) -> None:
        assert self.attempt is not None
        self._write(self.attempt)

    def _write(self, attempt: Attempt) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(attempt.model_dump_json())
        tmp.replace(self.path)
        self.written = time.time()

    def due(self) -> bool:
        return time.time() - self.written >= WRITE_EVERY_S

    def finish(self, evaluation_s: float = 0.0) -> GoodputSplit | None:
        """The work ended (trained, saved, validated): the split over every attempt (None on other ranks)."""
        if self.attempt is None:
            return None
        self.update(evaluation_s=evaluation_s, ended_at=time.time())
        self.write()
        return split(read_attempts(self.folder))

    def live(self) -> GoodputSplit | None:
        """The split so far, this attempt included."""
        if self.attempt is None:
            return None
        others = [a for a in read_attempts(self.folder) if a.started_at != self.started_at]
        return split([*others, self.attempt])


def read_attempts(folder: Path) -> list[Attempt]:
    """Every attempt's record in a goodput folder (one being rewritten is read from its last complete version)."""
    return [Attempt.model_validate_json(p.read_text()) for p in sorted(folder.glob("attempt-*.json"))]


def process_start() -> float:
    """When this process was created (epoch seconds): an attempt's start-up begins there, not at the trainer. Read as
    its age (/proc: uptime minus its start in clock ticks, 10 ms steps) before now: psutil's create_time adds the
    boot time, which Linux gives in whole seconds, and could put a restarted process before its predecessor's end."""
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return time.time() - (uptime - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):  # not Linux

        return psutil.Process(os.getpid()).create_time()
