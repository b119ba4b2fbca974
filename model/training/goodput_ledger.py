"""The goodput ledger as a training callback: rank 0's record of this attempt, rewritten at most every second
and at each checkpoint's submission (model/training/goodput.py has the records and the split)."""

from __future__ import annotations

import time
from pathlib import Path

from compass.infra.layout import CheckpointFolder
from compass.model.training.callbacks import Callback
from compass.model.training.goodput import AttemptFile, Sums
from compass.model.training.loop_view import TrainingLoop
from compass.model.training.records import GoodputSplit, MetricsRow


class GoodputLedger(Callback):
    """Rank 0's record of this attempt (model/training/goodput.py)."""

    def __init__(self, folder: Path, started_at: float, rank: int):
        self.record = AttemptFile(folder, started_at)
        if rank == 0:
            self.record.begin()

    def on_start(self, trainer: TrainingLoop) -> None:
        if trainer.rank == 0:
            self.record.start(trainer.step)

    def post_step(self, trainer: TrainingLoop, row: MetricsRow) -> None:
        attempt = self.record.attempt
        if attempt is None:
            return
        self.record.update(now=attempt.now.after(row, time.time()), step=trainer.step)
        if trainer.written is not None and CheckpointFolder(trainer.written).step == trainer.step:
            # a checkpoint of this step was just submitted (the Checkpointing callback runs first): an attempt
            # resuming from it starts again from these sums. Marked now, not once its background write commits,
            # so a kill between the two cannot lose the mark.
            attempt = self.record.attempt
            self.record.update(marks={**attempt.marks, trainer.step: attempt.now})
            self.record.write()
        elif self.record.due():
            self.record.write()

    def on_error(self, trainer: TrainingLoop, exc: BaseException) -> None:
        if self.record.attempt is not None:  # a stop asked (the time limit), a monitor's stop, a fault: its last record
            self.record.write()

    def post_restore(self, trainer: TrainingLoop, step: int) -> None:
        """A rollback went back to `step`'s checkpoint: the steps since are computed again."""
        attempt = self.record.attempt
        if attempt is None:
            return
        base = attempt.marks.get(step) or attempt.first_step or attempt.now
        lost = attempt.now.minus(base)
        now = Sums(at=time.time(), data_wait_s=base.data_wait_s, compute_s=base.compute_s,
                   checkpoint_s=base.checkpoint_s)
        self.record.update(now=now, step=step, redone_s=attempt.redone_s + lost.at)
        self.record.write()

    def finish(self, evaluation_s: float) -> GoodputSplit | None:
        """The stage trained to its end and was validated: the split over every attempt (rank 0; None elsewhere)."""
        return self.record.finish(evaluation_s)

    def live(self) -> GoodputSplit | None:
        """The split so far, this attempt included (for the live gauge)."""
        return self.record.live()
