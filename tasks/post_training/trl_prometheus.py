"""A TRL step's live metrics for Prometheus, from the Trainer's own callbacks: every rank serves the gauges the
compass trainer serves (model/training/telemetry.py RankEndpoint), so the Grafana dashboard, the hang alert (a rank
whose last-step time stops moving) and the goodput panel read post-training steps as they read pretraining ones."""

from __future__ import annotations

import os
import socket
import time
from typing import Any

from transformers import TrainerCallback

from compass.model.training.job import Telemetry
from compass.model.training.telemetry import GOODPUT_EVERY_S, RankEndpoint
from compass.tasks.post_training.trl_goodput import TrlGoodput

# what TRL logs (Trainer.log's keys) -> the gauge compass fills with it
LOGGED = {"loss": "compass_train_loss", "grad_norm": "compass_train_grad_norm",
          "learning_rate": "compass_train_learning_rate"}


class TrlPrometheus(TrainerCallback):
    """This rank's endpoint while the step trains: step, loss, grad norm and learning rate as TRL logs them, the
    time of the last optimizer step, and (rank 0) the step's goodput split so far."""

    def __init__(self, telemetry: Telemetry, ledger: TrlGoodput, cuda: bool):
        self.telemetry, self.ledger, self.cuda = telemetry, ledger, cuda
        self.endpoint: RankEndpoint | None = None
        self.goodput_at = 0.0

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        t = self.telemetry
        labels = {"run": t.run, "step": t.step, "stage": t.step.split(":", 1)[-1], "node": socket.gethostname(),
                  "rank": os.environ.get("RANK", "0")}
        self.endpoint = RankEndpoint(t, labels, int(os.environ.get("LOCAL_RANK", "0")), self._gpu_index())

    def _gpu_index(self) -> int | None:
        """The GPU NVML reads for this rank: the one accelerate opened (set by the time training begins)."""
        if not self.cuda:
            return None
        import torch

        return torch.cuda.current_device()

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        endpoint = self.endpoint
        if endpoint is None:
            return
        endpoint.set("compass_train_step", state.global_step)
        endpoint.set("compass_train_last_step_timestamp_seconds", time.time())
        if time.monotonic() - self.goodput_at >= GOODPUT_EVERY_S or state.global_step == state.max_steps:
            self.goodput_at = time.monotonic()
            split = self.ledger.record.live()  # None on ranks other than 0
            if split is not None:
                endpoint.set_goodput(split)

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None,
               **kwargs: Any) -> None:
        if self.endpoint is None:
            return
        for key, gauge in LOGGED.items():
            value = (logs or {}).get(key)
            if isinstance(value, int | float):
                self.endpoint.set(gauge, float(value))

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.close()

    def close(self) -> None:
        """Unregistered and stopped: training ended, or raised (tasks/post_training/trl_ranks.py `train`)."""
        if self.endpoint is not None:
            self.endpoint.close()
            self.endpoint = None
