"""What one training stage needs, typed: the recipe (what it computes, part of the step's identity) and the job
(the recipe plus where its data, tokenizer and work folder are and how it runs). A job is written as JSON for
launchers: every rank of `python -m compass.model.training.trainer JOB.json` reads the same file."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, PositiveInt

from compass.model.training.trackers import TrackerRun
from compass.specs.architecture import Architecture
from compass.specs.how import (
    PEAK_TFLOPS,
    AttentionBackend,
    Checkpoints,
    Hardware,
    How,
    LossKernel,
    Parallelism,
    Precision,
)
from compass.specs.training import Monitors, Optimizer, PretrainStage, Schedule


class StageRecipe(BaseModel):
    """One stage of a schedule that may span several stages: the model, the optimizer, the LR schedule over
    `stages`, which of them to train, the seed, masking and monitors."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    architecture: Architecture
    optimizer: Optimizer
    schedule: Schedule
    stages: list[PretrainStage]
    stage: str
    seed: int
    intra_document_masking: bool
    monitors: Monitors

    @property
    def current(self) -> PretrainStage:
        return next(s for s in self.stages if s.name == self.stage)

    @property
    def max_positions(self) -> int:
        return max(s.sequence_length for s in self.stages)


class SpecialIds(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    eos: int
    pad: int


class Staging(BaseModel):
    """Node-local copies of the sources: each node's first rank copies `uris` from the store into `cache`
    (verified against the manifests) before any rank reads; `sources` already name those copies."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    store_root: str
    cache: Path
    uris: dict[str, str]
    capacity_bytes: int | None = None  # how.storage.local_cache_gib: staging makes room within it


class Telemetry(BaseModel):
    """Where and how a training job reports live (how.monitoring): labels, the run's monitoring folder (Prometheus
    service-discovery targets, TensorBoard runs) and each rank's endpoint."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    run: str
    step: str
    folder: Path
    prometheus: bool = True
    listen: str = "127.0.0.1"
    port: int | None = None
    tensorboard: bool = True
    trackers: TrackerRun | None = None  # MLflow, W&B, trackio (how.monitoring.trackers)


class TrainJob(BaseModel):
    """A recipe bound to files and hardware. `init_from` continues a previous stage's full state, `init_weights`
    starts from an exported Hugging Face model (a starting checkpoint: its weights, a fresh optimizer); `whole_from`
    keeps documents longer than that length whole (long context); `tokens_before` continues the token count.

    `how` is the spec's whole `how` as this job runs it (its phase's nodes and devices, the data parallelism they
    leave, the stage's micro-batch): carried one way, as the TRL and lighteval jobs carry it. The properties below
    read it; `with_how` changes it, and `model_copy` refuses a key that is not a field (one that names a `how`
    section would otherwise be set beside the property and silently change nothing)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    recipe: StageRecipe
    workdir: Path
    tokenizer_dir: Path
    vocab_size: PositiveInt
    special_ids: SpecialIds
    sources: dict[str, Path]
    how: How
    staging: Staging | None = None
    init_from: Path | None = None
    init_weights: Path | None = None
    whole_from: int | None = None
    tokens_before: int = 0
    # every exported checkpoint is evaluated (how.evaluation.every_checkpoint): keep_last prunes its training state
    # only, the export waits in the work folder's evaluation-pending/ for the artifact
    keep_exports_until_evaluated: bool = False
    telemetry: Telemetry | None = None
    prefetch: int = 2  # batches packed ahead on a background thread (0: pack in the training thread)

    @property
    def parallelism(self) -> Parallelism:
        return self.how.parallelism

    @property
    def micro_batch_size(self) -> int:
        return self.how.parallelism.micro_batch_size

    @property
    def precision(self) -> Precision:
        return self.how.precision

    @property
    def hardware(self) -> Hardware:
        return self.how.hardware

    @property
    def checkpoints(self) -> Checkpoints:
        return self.how.checkpoints

    @property
    def attention(self) -> AttentionBackend:
        return self.how.attention

    @property
    def compile(self) -> bool:
        return self.how.compile

    @property
    def loss(self) -> LossKernel:
        return self.how.loss

    @property
    def hang_timeout_s(self) -> float:
        """how.monitoring.hang_timeout_s (model/training/watchdog.py)."""
        return self.how.monitoring.hang_timeout_s

    def with_how(self, **sections: Any) -> TrainJob:
        """This job with some of its `how` sections (or top-level `how` fields: precision, compile, ...) replaced."""
        unknown = sorted(set(sections) - set(How.model_fields))
        if unknown:
            raise TypeError(f"with_how: {unknown} are not fields of how (its fields: {sorted(How.model_fields)})")
        return self.model_copy(update={"how": self.how.model_copy(update=sections)})

    def model_copy(self, *, update: Mapping[str, Any] | None = None, deep: bool = False) -> TrainJob:
        unknown = sorted(set(update or {}) - set(type(self).model_fields))
        if unknown:
            raise TypeError(f"TrainJob.model_copy: {unknown} are not fields of a job; a `how` section changes "
                            f"with job.with_how({unknown[0]}=...)")
        return super().model_copy(update=update, deep=deep)

    @property
    def world_size(self) -> int:
        par = self.parallelism
        return par.data_parallel * par.tensor_parallel * par.pipeline_parallel

    @property
    def peak_tflops(self) -> float | None:
        """The spec's or the data sheet's peak for GPUs; None on CPU, where the trainer measures one."""
        hw = self.hardware
        if hw.peak_tflops:
            return hw.peak_tflops
        return None if hw.accelerator == "cpu" else PEAK_TFLOPS[hw.accelerator]

    def write(self, path: Path) -> None:
        path.write_text(self.model_dump_json(indent=1))

    @classmethod
    def read(cls, path: Path) -> TrainJob:
        return cls.model_validate_json(path.read_text())
