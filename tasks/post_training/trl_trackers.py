"""TRL's steps report to the spec's MLflow, W&B and trackio runs like every other training step: the same run
identity, parameters and token axis (model/training/trackers.py), through a transformers TrainerCallback. TRL's
own `report_to` integrations would open their runs with their own names, parameters and global-step axis (and
upload checkpoints), so the step's runs would not line up with its pretraining's."""

from __future__ import annotations

from typing import Any

from compass.model.training.trackers import TrackerRun, Trackers


def tracker_callback(run: TrackerRun) -> Any:
    from transformers import TrainerCallback

    class TrackerCallback(TrainerCallback):
        """Opens the step's runs when training begins; every log line of the Trainer goes to them, against the
        tokens trained on (TRL's count of non-padding tokens, else the optimizer step)."""

        def __init__(self) -> None:
            self.trackers: Trackers | None = None

        def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self.trackers = Trackers(run)

        def on_log(self, args: Any, state: Any, control: Any, logs: dict | None = None, **kwargs: Any) -> None:
            if self.trackers is None or not logs:
                return
            tokens = int(state.num_input_tokens_seen or logs.get("num_tokens") or state.global_step)
            self.trackers.log({f"train/{k}": v for k, v in logs.items()}, tokens)

        def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self.close_trackers(failed=False)

        def close_trackers(self, failed: bool) -> None:
            if self.trackers is not None:
                self.trackers.close(failed)
                self.trackers = None

    return TrackerCallback()
