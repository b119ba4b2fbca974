"""The goodput ledger of a TRL step: rank 0's record of each attempt (a kill, a requeue, a retry), in the same
records as the compass trainer's (model/training/goodput.py), from the Trainer's own callbacks. The Trainer fetches
an optimizer step's batches before `on_step_begin`, so the time from one step's end to the next one's begin is
waiting for data (and logging); `on_step_begin` to `on_step_end` is compute; `on_step_end` to `on_save` is the
checkpoint (the save and CompleteCheckpoints' barriers, which run before this callback)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from transformers import TrainerCallback

from compass.model.training.goodput import AttemptFile, Sums
from compass.model.training.records import GoodputSplit


class TrlGoodput(TrainerCallback):
    """Rank 0's record of this attempt at a TRL step (written at most every second and at each checkpoint)."""

    def __init__(self, folder: Path, started_at: float, rank: int):
        self.record = AttemptFile(folder, started_at)
        if rank == 0:
            self.record.begin()
        self.began = 0.0  # the current optimizer step's begin
        self.last = 0.0  # where the last step (and its checkpoint) ended

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.is_world_process_zero:
            self.record.start(state.global_step)  # the checkpoint's step when resuming
            self.last = time.time()

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.began = time.time()

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        attempt = self.record.attempt
        if attempt is None:
            return
        now, sums = time.time(), attempt.now
        self.record.update(now=Sums(at=now, data_wait_s=sums.data_wait_s + (self.began - self.last),
                                    compute_s=sums.compute_s + (now - self.began), checkpoint_s=sums.checkpoint_s),
                           step=state.global_step)
        self.last = now
        if self.record.due():
            self.record.write()

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        attempt = self.record.attempt
        if attempt is None:
            return
        now, sums = time.time(), attempt.now
        sums = Sums(at=now, data_wait_s=sums.data_wait_s, compute_s=sums.compute_s,
                    checkpoint_s=sums.checkpoint_s + (now - self.last))
        self.record.update(now=sums, marks={**attempt.marks, state.global_step: sums})
        self.last = now
        self.record.write()

    def failed(self) -> None:
        """The attempt ended in an exception (a stop asked, a fault): its last record."""
        if self.record.attempt is not None:
            self.record.write()

    def finish(self) -> GoodputSplit | None:
        """Trained and saved: the step's split over every attempt (rank 0; None on other ranks)."""
        return self.record.finish()
