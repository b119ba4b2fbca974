"""TRL checkpoints that survive kill -9 and requeue: a checkpoint counts once every rank has written its part
and rank 0 has marked it complete (the Trainer writes straight into `checkpoint-<step>`, so a kill mid-save leaves
a folder that looks whole); the newest complete one is resumed from, and only complete ones are kept."""

from __future__ import annotations

import re
import shutil
import time
from pathlib import Path

from transformers import TrainerCallback

COMPLETE = "compass-complete"
_NAME = re.compile(r"checkpoint-(\d+)")


def checkpoints(root: Path) -> list[tuple[int, Path, bool]]:
    """(step, folder, complete) of every `checkpoint-<step>` under `root`, oldest first."""
    found = []
    for folder in root.glob("checkpoint-*"):
        if (match := _NAME.fullmatch(folder.name)) and folder.is_dir():
            found.append((int(match.group(1)), folder, (folder / COMPLETE).exists()))
    return sorted(found)


def newest_complete(root: Path) -> Path | None:
    done = [folder for _, folder, complete in checkpoints(root) if complete]
    return done[-1] if done else None


class CompleteCheckpoints(TrainerCallback):
    """After each save: wait for every rank, mark the checkpoint complete (atomically), then drop all but the newest
    `keep` complete checkpoints and any incomplete one older than the newest."""

    def __init__(self, root: Path, keep: int):
        self.root, self.keep = root, keep

    def on_save(self, args, state, control, **kwargs):
        from compass.model.training import collectives

        collectives.barrier()
        if state.is_world_process_zero:
            folder = self.root / f"checkpoint-{state.global_step}"
            tmp = folder / f"{COMPLETE}.tmp"
            tmp.write_text(str(state.global_step))
            tmp.replace(folder / COMPLETE)
            found = checkpoints(self.root)
            complete = [f for _, f, ok in found if ok]
            stale = [f for step, f, ok in found if not ok and step < state.global_step] + complete[:-self.keep]
            for old in stale:
                shutil.rmtree(old, ignore_errors=True)
        collectives.barrier()
        return control


class StopAndSave(TrainerCallback):
    """A TRL step near its Slurm time limit (the batch shell touches the stop file on USR1; a rank's own USR1 sets
    `signalled`) saves a complete checkpoint after the current step and stops, every rank at the same step (the
    ranks agree through one all-reduce per step); the requeued job resumes from it. With `every_s`, it also saves
    when that long has passed since the last save (a step whose optimizer steps are long: a 2-day SFT at 64k saving
    every 2,000 steps would never save before its time limit)."""

    signalled = False  # set by the USR1 handler of the ranks' main (trl_ranks.py)

    def __init__(self, stop_file: Path | None, every_s: float | None = None):
        self.stop_file, self.every_s = stop_file, every_s
        self.saved_at = time.monotonic()
        self.stopped_at: int | None = None  # the step it stopped after

    def on_step_end(self, args, state, control, **kwargs):
        from compass.model.training import collectives

        asked = StopAndSave.signalled or (state.is_world_process_zero and self.stop_file is not None
                                          and self.stop_file.exists())
        due = self.every_s is not None and time.monotonic() - self.saved_at >= self.every_s
        stop, save = collectives.any_rank(asked), collectives.any_rank(due)  # rank 0's clock and file decide
        if stop and state.global_step < state.max_steps:
            control.should_save = control.should_training_stop = True
            self.stopped_at = state.global_step
        elif save:
            control.should_save = True
        return control

    def on_save(self, args, state, control, **kwargs):
        self.saved_at = time.monotonic()
        return control
