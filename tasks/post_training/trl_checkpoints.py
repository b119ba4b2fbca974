"""TRL checkpoints that survive kill -9 and requeue: a checkpoint counts once every rank has written its part
and rank 0 has marked it complete (the Trainer writes straight into `checkpoint-<step>`, so a kill mid-save leaves
a folder that looks whole); the newest complete one is resumed from, and only complete ones are kept."""

from __future__ import annotations

import re
import shutil
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
