"""What a TRL step's ranks are handed and what they hand back: the job (method section, where the start model,
rows and checkpoints live, the device) and the result (the trainer's log, its step count, facts for the manifest).
One rank runs it in the step's own process; several run it under torchrun or srun (tasks/post_training/trl_ranks.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field

from compass.model.training.job import Telemetry
from compass.model.training.records import GoodputSplit
from compass.model.training.trackers import TrackerRun
from compass.specs.how import How
from compass.specs.post_training import Distillation, Grpo, Preference, Sft

TrlSection = Annotated[Sft | Preference | Grpo | Distillation, Field(discriminator="method")]


class TrlJob(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    step: str  # post_train:<name>, for messages
    section: TrlSection
    seed: int
    how: How
    work: Path  # the step's work folder (infra/layout.py WorkFolder): on the shared root under a cluster
    world: int  # ranks training together
    device: str  # "cuda" or "cpu"
    bf16: bool
    teacher: Path | None = None  # distillation: the teacher's exported folder
    tensorboard: Path | None = None  # the step's TensorBoard run
    trackers: TrackerRun | None = None  # its MLflow, W&B and trackio run (how.monitoring.trackers)
    prometheus: Telemetry | None = None  # each rank's endpoint: labels, targets folder, port (how.monitoring)

    def write(self, path: Path) -> None:
        path.write_text(self.model_dump_json(indent=1))

    @classmethod
    def read(cls, path: Path) -> TrlJob:
        return cls.model_validate_json(path.read_text())


class TrlResult(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    log_history: list[dict[str, Any]]
    global_step: int
    resumed_from: int | None  # the checkpoint's step this attempt resumed from
    facts: dict[str, Any] = {}
    goodput: GoodputSplit | None = None  # where the step's wall time went, over every attempt (trl_goodput.py)

    def write(self, path: Path) -> None:
        tmp = path.with_suffix(".tmp")
        tmp.write_text(self.model_dump_json(indent=1))
        tmp.replace(path)

    @classmethod
    def read(cls, path: Path) -> TrlResult:
        return cls.model_validate_json(path.read_text())
