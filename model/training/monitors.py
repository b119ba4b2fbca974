"""Training monitors for the failure patterns the playbook lists, each reported with its likely cause and
remedy; the spec chooses the action (warn, roll back to the last good checkpoint and skip the offending
batches, or stop)."""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass
from typing import Any

from compass.model.training.records import MonitorEvent
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


# A throughput drop diagnosed from where the step's time went, in the playbook's order: data loader, network, kernels
PHASE_CAUSES = {
    "data_wait": ("the data loader or storage: waiting for batches grew",
                  "check the loader's prefetch and workers and the storage's read speed (evictions on a shared file "
                  "system: stage the data on local NVMe with how.storage.local_cache)"),
    "sync": ("the network or a slower rank: waiting on the other ranks grew",
             "check the interconnect and look for a straggler (compass preflight measures all-reduce bandwidth and "
             "flags slow nodes to exclude)"),
    "forward_backward": ("compute: the forward and backward pass got slower (kernels or throttling)",
                         "check GPU clocks, temperature and throttle reasons (compass_gpu_* metrics), and any change "
                         "of kernels or sequence shapes"),
    "optimizer": ("compute: the optimizer step got slower (kernels or throttling)",
                  "check GPU clocks and throttle reasons, and memory pressure on the host (offloaded states)"),
    "checkpoint": ("checkpoint writes are blocking training",
                   "write checkpoints asynchronously (how.checkpoints.asynchronous) or to faster storage"),
}
PHASE_ORDER = ("data_wait", "sync", "forward_backward", "optimizer", "checkpoint")
# the same diagnosis on CPU ranks: no GPU clocks to check
CPU_REMEDIES = {
    "forward_backward": "check what else runs on the machine's cores (other ranks' processes, OpenMP threads per rank: "
                        "OMP_NUM_THREADS), the CPU's clock (frequency scaling), and any change of kernels or sequence "
                        "shapes",
    "optimizer": "check what else runs on the machine's cores and the host's memory pressure (swapping)",
}


@dataclass(frozen=True)
class Event:
    kind: str
    step: int
    action: str
    detail: str
    phase: str | None = None  # for a throughput drop: the part of the step that grew most
    on_gpu: bool = True  # where the ranks compute: the remedy names what to check there

    @property
    def cause(self) -> str:
        return PHASE_CAUSES[self.phase][0] if self.phase else CAUSES[self.kind][0]

    @property
    def remedy(self) -> str:
        if self.phase and not self.on_gpu and self.phase in CPU_REMEDIES:
            return CPU_REMEDIES[self.phase]
        return PHASE_CAUSES[self.phase][1] if self.phase else CAUSES[self.kind][1]

    def describe(self) -> str:
        return f"step {self.step}: {self.kind} ({self.detail}). Likely cause: {self.cause}. Remedy: {self.remedy}."

    def as_record(self) -> MonitorEvent:
        return MonitorEvent(kind=self.kind, step=self.step, action=self.action, detail=self.detail,
                            cause=self.cause, remedy=self.remedy, phase=self.phase)


SPEED_HISTORY = 1000


class TrainingMonitor:
    """Fed one (loss, grad norm, tokens/s) per optimizer step; returns the events that step raised."""

    def __init__(self, config: Monitors, on_gpu: bool = True):
        self.cfg = config
        self.on_gpu = on_gpu
        self.losses: deque[float] = deque(maxlen=config.spike.window if config.spike else 50)
        trend_windows = [m.window for m in (config.slow_rise, config.plateau) if m]
        self.history: deque[float] = deque(maxlen=max(trend_windows + [1]))
        # the throughput baseline: the last SPEED_HISTORY steps (its cost per step must not grow with the run)
        self.speeds: deque[float] = deque(maxlen=SPEED_HISTORY)
        self.phases: deque[dict[str, float]] = deque(maxlen=SPEED_HISTORY)
        self.warned: set[str] = set()

    def state_dict(self) -> dict[str, Any]:
        """The windows and what was reported: a resumed run goes on judging against the same history."""
        return {"losses": list(self.losses), "history": list(self.history), "speeds": list(self.speeds),
                "phases": list(self.phases), "warned": sorted(self.warned)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.losses.extend(state["losses"])
        self.history.extend(state["history"])
        self.speeds.extend(state["speeds"])
        self.phases.extend(state["phases"])
        self.warned = set(state["warned"])

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

    def record(self, step: int, loss: float, tokens_per_s: float,
               phases: dict[str, float] | None = None) -> list[Event]:
        """After a good step: update the windows and report trends (each kind is reported once). `phases` is
        where the step's time went (seconds per phase): a throughput drop names the phase that grew."""
        self.losses.append(loss)
        self.history.append(loss)
        self.speeds.append(tokens_per_s)
        self.phases.append(phases or {})
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
            median = statistics.median(list(self.speeds)[:-1])
            recent = statistics.fmean(list(self.speeds)[-min(5, tp.window):])
            if recent < tp.ratio * median:
                phase, growth = self._phase_that_grew(min(5, tp.window))
                events.append(Event("throughput", step, tp.action,
                                    f"{recent:,.0f} tokens/s vs median {median:,.0f}{growth}", phase, self.on_gpu))
        self.warned |= {e.kind for e in events}
        return events

    def _phase_that_grew(self, recent: int) -> tuple[str | None, str]:
        """The phase whose time per step grew most (recent steps' mean against the earlier median), looked at in
        the playbook's order so that a tie names the data loader before the network before the kernels."""
        grown: list[tuple[float, str, float, float]] = []
        for phase in PHASE_ORDER:
            phases = list(self.phases)
            before = [p[phase] for p in phases[:-recent] if phase in p]
            after = [p[phase] for p in phases[-recent:] if phase in p]
            if before and after:
                was, now = statistics.median(before), statistics.fmean(after)
                grown.append((now - was, phase, was, now))
        if not grown:
            return None, ""
        delta, phase, was, now = max(grown, key=lambda g: (g[0], -PHASE_ORDER.index(g[1])))
        if delta <= 0:
            return None, ""
        return phase, f"; {phase.replace('_', ' ')} grew from {was * 1000:.0f} to {now * 1000:.0f} ms per step"

    def forget_since_rollback(self) -> None:
        """After a rollback the windows restart from the restored model's behaviour."""
        self.losses.clear()
        self.history.clear()


class TrainingStopped(RuntimeError):
    """Raised when a monitor's action is stop, or rollbacks exceed the spec's limit."""

    def __init__(self, event: Event, reason: str = ""):
        self.event = event
        super().__init__(f"training stopped at {event.describe()}{' ' + reason if reason else ''}")
