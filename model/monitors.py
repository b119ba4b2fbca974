"""Training monitors for the failure patterns the playbook lists, each reported with its likely cause and
remedy; the spec chooses the action (warn, roll back to the last good checkpoint and skip the offending
batches, or stop)."""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass
from typing import Any

from compass.specs.training import Monitors

CAUSES = {
    "divergence": ("the loss or gradient norm is not finite: numerical instability, often an LR too high",
                   "roll back; lower the LR or warm up longer; z-loss and QK-norm help stability"),
    "spike": ("a sudden loss spike: usually a bad batch (data), sometimes an LR too high",
              "roll back to the last good checkpoint and skip the batches that caused it; inspect their documents"),
    "slow_rise": ("the loss has been rising slowly: the learning rate is likely too high",
                  "lower the peak LR or lengthen the warmup"),
    "plateau": ("the loss stopped improving: the run needs a change of strategy",
                "change the data mixture or the schedule (e.g. start the WSD decay)"),
    "throughput": ("throughput dropped well below its median",
                   "check the dataloader first (storage evictions, growing indexes), then communication, then kernels"),
}


@dataclass(frozen=True)
class Event:
    kind: str
    step: int
    action: str
    detail: str

    @property
    def cause(self) -> str:
        return CAUSES[self.kind][0]

    @property
    def remedy(self) -> str:
        return CAUSES[self.kind][1]

    def describe(self) -> str:
        return f"step {self.step}: {self.kind} ({self.detail}). Likely cause: {self.cause}. Remedy: {self.remedy}."

    def as_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "step": self.step, "action": self.action, "detail": self.detail,
                "cause": self.cause, "remedy": self.remedy}


class TrainingMonitor:
    """Fed one (loss, grad norm, tokens/s) per optimizer step; returns the events that step raised."""

    def __init__(self, config: Monitors):
        self.cfg = config
        self.losses: deque[float] = deque(maxlen=config.spike.window if config.spike else 50)
        trend_windows = [m.window for m in (config.slow_rise, config.plateau) if m]
        self.history: deque[float] = deque(maxlen=max(trend_windows + [1]))
        self.speeds: list[float] = []
        self.warned: set[str] = set()

    def check_before_step(self, step: int, loss: float, grad_norm: float) -> Event | None:
        """Checks that must run before the optimizer applies this step's gradients."""
        if not (math.isfinite(loss) and math.isfinite(grad_norm)):
            return Event("divergence", step, self.cfg.divergence.action, f"loss {loss}, grad norm {grad_norm}")
        spike = self.cfg.spike
        if spike and len(self.losses) >= min(10, self.losses.maxlen or 10):
            mean = statistics.fmean(self.losses)
            std = statistics.pstdev(self.losses) or 1e-8
            if loss > mean + spike.sigma * std and loss > mean * 1.05:
                return Event("spike", step, spike.action,
                             f"loss {loss:.4f} vs recent mean {mean:.4f} ± {std:.4f}")
        return None

    def record(self, step: int, loss: float, tokens_per_s: float) -> list[Event]:
        """After a good step: update the windows and report trends (each kind is reported once)."""
        self.losses.append(loss)
        self.history.append(loss)
        self.speeds.append(tokens_per_s)
        events = []
        for kind, cfg in (("slow_rise", self.cfg.slow_rise), ("plateau", self.cfg.plateau)):
            if not cfg or kind in self.warned or len(self.history) < cfg.window:
                continue
            window = list(self.history)[-cfg.window:]
            half = len(window) // 2
            early, late = statistics.fmean(window[:half]), statistics.fmean(window[half:])
            change = (late - early) / abs(early)
            span = f"over {cfg.window} steps"
            if kind == "slow_rise" and change > cfg.threshold:
                events.append(Event(kind, step, cfg.action, f"mean loss rose {change:.1%} {span}"))
            if kind == "plateau" and abs(change) < cfg.threshold:
                events.append(Event(kind, step, cfg.action, f"mean loss moved {change:.2%} {span}"))
        tp = self.cfg.throughput
        if tp and "throughput" not in self.warned and len(self.speeds) > tp.window:
            median = statistics.median(self.speeds[:-1])
            recent = statistics.fmean(self.speeds[-min(5, tp.window):])
            if recent < tp.ratio * median:
                events.append(Event("throughput", step, tp.action,
                                    f"{recent:,.0f} tokens/s vs median {median:,.0f}"))
        self.warned |= {e.kind for e in events}
        return events

    def forget_since_rollback(self) -> None:
        """After a rollback the windows restart from the restored model's behaviour."""
        self.losses.clear()
        self.history.clear()


class TrainingStopped(RuntimeError):
    """Raised when a monitor's action is stop, or rollbacks exceed the spec's limit."""

    def __init__(self, event: Event, reason: str = ""):
        self.event = event
        super().__init__(f"training stopped at {event.describe()}{' ' + reason if reason else ''}")
