"""`what.pretraining` and `what.long_context`: staged training with mixtures and one LR schedule across stages."""

from typing import Literal

from pydantic import Field, PositiveFloat, PositiveInt

from compass.specs.base import NAME_MAX, SpecModel


class Optimizer(SpecModel):
    """AdamW, with the playbook's defaults."""

    lr: PositiveFloat = 2e-4
    betas: tuple[float, float] = (0.9, 0.95)
    eps: PositiveFloat = 1e-8
    weight_decay: float = Field(default=0.1, ge=0)
    grad_clip: float = Field(default=1.0, ge=0, description="Max gradient norm (0 = no clipping).")


class Schedule(SpecModel):
    """One LR schedule spanning every stage, so a WSD or multi-step run can be extended without restarting."""

    kind: Literal["wsd", "cosine", "multistep", "constant"] = "wsd"
    warmup_steps: int = Field(default=0, ge=0)
    decay_fraction: float = Field(
        default=0.1, gt=0, le=1, description="wsd: share of all steps spent decaying (when no stage says decay)."
    )
    min_lr_ratio: float = Field(default=0.0, ge=0, le=1)
    milestones: list[float] = Field(
        default_factory=list, description="multistep: fractions of all steps where the LR is multiplied by gamma."
    )
    gamma: float = Field(default=0.316, gt=0, le=1)


class PretrainStage(SpecModel):
    """A stage: a token budget over a data mixture at one sequence length."""

    name: str = Field(max_length=NAME_MAX, pattern=r"^[a-z][a-z0-9_]*$")
    tokens: PositiveFloat = Field(description="Token budget of the stage (e.g. 8e12).")
    sequence_length: PositiveInt
    global_batch_size: PositiveInt = Field(description="Sequences per optimizer step, over all replicas.")
    mixture: dict[str, float] = Field(min_length=1, description="Source name -> sampling weight; sums to 1.")
    schedule_segment: Literal["auto", "stable", "decay"] = Field(
        default="auto", description="wsd: 'decay' marks the stage(s) the LR decays in."
    )
    reset_optimizer: bool = Field(default=False, description="Start the stage with fresh optimizer state.")


MonitorAction = Literal["warn", "rollback", "stop"]


class SpikeMonitor(SpecModel):
    """Sudden loss spike: above the recent mean by `sigma` standard deviations (usually a bad batch)."""

    sigma: PositiveFloat = 6.0
    window: PositiveInt = 50
    action: MonitorAction = "rollback"


class DivergenceMonitor(SpecModel):
    """NaN or infinite loss or gradient norm."""

    action: Literal["rollback", "stop"] = "rollback"


class TrendMonitor(SpecModel):
    """Slow rise (LR too high) or plateau (time for a change of data or schedule) over a window of steps."""

    window: PositiveInt = 200
    threshold: PositiveFloat = 0.02
    action: Literal["warn", "stop"] = "warn"


class ThroughputMonitor(SpecModel):
    """Tokens/s below `ratio` x the median so far: dataloader, then communication, then kernels."""

    ratio: float = Field(default=0.5, gt=0, lt=1)
    window: PositiveInt = 20
    action: Literal["warn", "stop"] = "warn"


class Monitors(SpecModel):
    spike: SpikeMonitor | None = SpikeMonitor()
    divergence: DivergenceMonitor = DivergenceMonitor()
    slow_rise: TrendMonitor | None = TrendMonitor()
    plateau: TrendMonitor | None = TrendMonitor(window=400, threshold=0.002)
    throughput: ThroughputMonitor | None = ThroughputMonitor()
    max_rollbacks: int = Field(default=3, ge=0, description="Then stop: repeated rollbacks mean a deeper problem.")


class Pretraining(SpecModel):
    seed: int = 1234
    monitors: Monitors = Monitors()
    optimizer: Optimizer = Optimizer()
    schedule: Schedule = Schedule()
    intra_document_masking: bool = True
    stages: list[PretrainStage] = Field(
        default_factory=list, description="At least one from random weights; none to fine-tune what.model.init_from.")


class Yarn(SpecModel):
    """Inference-time scaling written into the exported config (beyond the trained length)."""

    kind: Literal["yarn", "linear"] = "yarn"
    factor: PositiveFloat = 2.0


class LongContextStage(SpecModel):
    """A context-extension stage: a longer sequence length and a larger RoPE base."""

    name: str = Field(max_length=NAME_MAX, pattern=r"^[a-z][a-z0-9_]*$")
    sequence_length: PositiveInt
    rope_theta: PositiveFloat
    tokens: PositiveFloat
    global_batch_size: PositiveInt
    mixture: dict[str, float] = Field(min_length=1)
    micro_batch_size: PositiveInt | None = Field(
        default=None, description="Overrides how.parallelism.micro_batch_size: long sequences need smaller ones."
    )
    lr: PositiveFloat = 2e-5
    schedule: Literal["wsd", "cosine", "constant"] = "wsd"
    warmup_steps: int = Field(default=0, ge=0)
    decay_fraction: float = Field(default=0.1, gt=0, le=1, description="wsd: share of the stage's steps spent "
                                                                       "decaying to zero.")


class LongContext(SpecModel):
    stages: list[LongContextStage] = Field(default_factory=list)
    inference_scaling: Yarn | None = None
    retrieval_depths: list[float] = Field(default_factory=lambda: [0.1, 0.5, 0.9],
                                          description="Needle depths of the passkey retrieval evaluation (0-1).")
    retrieval_samples: PositiveInt = Field(default=10, description="Passkey prompts per (length, depth).")
    retrieval_source: str | None = Field(
        default=None, description="Source whose held-out text is the haystack (default: the first stage's "
                                  "most weighted source).")
