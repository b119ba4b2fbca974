"""What a callback sees of the training loop: the trainer's public face, as a Protocol.

Callbacks, telemetry, the watchdog and the goodput ledger are typed against `TrainingLoop`, not the Trainer class:
trainer.py imports them to build its callback list, so naming the class back would close a circle of imports (even
one under TYPE_CHECKING is coupling). Anything a callback reads or calls is listed here; the Trainer provides it.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from compass.model.training.job import TrainJob
from compass.model.training.monitors import Event
from compass.model.training.records import GoodputSplit, MonitorEvent
from compass.specs.training import PretrainStage

if TYPE_CHECKING:
    import torch


class LiveLedger(Protocol):
    """The goodput ledger as telemetry reads it: the split so far, this attempt included."""

    def live(self) -> GoodputSplit: ...


class TrainingLoop(Protocol):
    """The Trainer's public face: where it is, what it trains, and the few actions a callback may take."""

    job: TrainJob
    rank: int
    device: torch.device
    stage: PretrainStage
    offset: int  # optimizer steps of the stages before this one
    stage_steps: int
    step: int  # optimizer steps of this stage done so far
    events: list[MonitorEvent]
    ledger: LiveLedger
    written: Path | None  # a checkpoint submitted to the writer, not yet announced
    checkpoint_root: Path
    checkpoint_blocked_s: float
    stop_asked_here: Callable[[], bool]
    stop_asked: bool
    monitor_stop: Event | None
    monitor_stopped: bool

    @property
    def tokens_per_step(self) -> int: ...

    @property
    def global_step(self) -> int: ...

    def report(self, event: Event) -> None: ...

    def save_checkpoint(self, export: bool = True) -> Path: ...

    def settle_checkpoint_writes(self) -> float: ...
