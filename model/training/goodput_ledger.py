"""The goodput ledger as a training callback: rank 0's record of this attempt, rewritten at most every second
and at each checkpoint's submission (model/training/goodput.py has the records and the split)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING

from compass.infra.layout import CheckpointFolder
from compass.model.training.callbacks import Callback
from compass.model.training.goodput import Attempt, Sums, read_attempts, split
from compass.model.training.records import GoodputSplit, MetricsRow

if TYPE_CHECKING:
    from compass.model.training.trainer import Trainer

WRITE_EVERY_S = 1.0


class GoodputLedger(Callback):
    """Rank 0's record of this attempt (model/training/goodput.py)."""

    def __init__(self, folder: Path, started_at: float):
        self.folder = folder
        self.started_at = started_at
        self.path = folder / f"attempt-{int(self.started_at * 1e6):020d}.json"
        self.attempt: Attempt | None = None
        self.written = 0.0

    def on_start(self, trainer: Trainer) -> None:
        if trainer.rank != 0:
            return
        now = time.time()
        self.attempt = Attempt(started_at=self.started_at, resumed_from=trainer.step, first_step=Sums(at=now),
                               now=Sums(at=now), step=trainer.step, marks={trainer.step: Sums(at=now)})
        self._write()

    def post_step(self, trainer: Trainer, row: MetricsRow) -> None:
        if self.attempt is None:
            return
        now = time.time()
        self.attempt = self.attempt.model_copy(update={"now": self.attempt.now.after(row, now), "step": trainer.step})
        if trainer.written is not None and CheckpointFolder(trainer.written).step == trainer.step:
            # a checkpoint of this step was just submitted (the Checkpointing callback runs first): an attempt
            # resuming from it starts again from these sums. Marked now, not once its background write commits,
            # so a kill between the two cannot lose the mark.
            marks = {**self.attempt.marks, trainer.step: self.attempt.now}
            self.attempt = self.attempt.model_copy(update={"marks": marks})
            self._write()
        elif now - self.written >= WRITE_EVERY_S:
            self._write()

    def on_error(self, trainer: Trainer, exc: BaseException) -> None:
        if self.attempt is not None:  # a stop asked (the time limit), a monitor's stop, a fault: its last record
            self._write()

    def post_restore(self, trainer: Trainer, step: int) -> None:
        """A rollback went back to `step`'s checkpoint: the steps since are computed again."""
        if self.attempt is None:
            return
        base = self.attempt.marks.get(step) or self.attempt.first_step or self.attempt.now
        lost = self.attempt.now.minus(base)
        now = Sums(at=time.time(), data_wait_s=base.data_wait_s, compute_s=base.compute_s,
                   checkpoint_s=base.checkpoint_s)
        self.attempt = self.attempt.model_copy(update={"now": now, "step": step,
                                                       "redone_s": self.attempt.redone_s + lost.at})
        self._write()

    def finish(self, evaluation_s: float) -> GoodputSplit | None:
        """The stage trained to its end and was validated: the split over every attempt (rank 0; None elsewhere)."""
        if self.attempt is None:
            return None
        self.attempt = self.attempt.model_copy(update={"evaluation_s": evaluation_s, "ended_at": time.time()})
        self._write()
        return split(read_attempts(self.folder))

    def live(self) -> GoodputSplit | None:
        """The split so far, this attempt included (for the live gauge)."""
        if self.attempt is None:
            return None
        others = [a for a in read_attempts(self.folder) if a.started_at != self.started_at]
        return split([*others, self.attempt])

    def _write(self) -> None:
        assert self.attempt is not None
        self.folder.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(self.attempt.model_dump_json())
        tmp.replace(self.path)
        self.written = time.time()
