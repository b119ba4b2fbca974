"""`what.pretraining` and `what.long_context`: staged training with mixtures and one LR schedule across stages."""

from collections.abc import Iterator
from typing import Literal

from pydantic import Field, PositiveFloat, PositiveInt

from compass.specs.base import NAME_MAX, Issue, Loc, SpecModel, unused
from compass.specs.limits import MAX_TOKENS


class Optimizer(SpecModel):
    """AdamW, with the playbook's defaults."""

    lr: PositiveFloat = Field(default=2e-4, description="Peak learning rate, scaled by the schedule (long context "
                                                        "and mid-training set their own).")
    betas: tuple[float, float] = Field(default=(0.9, 0.95), description="AdamW's decay rates of the first and "
                                                                        "second moment estimates.")
    eps: PositiveFloat = Field(default=1e-8, description="AdamW's epsilon, added to the denominator for stability.")
    weight_decay: float = Field(default=0.1, ge=0, description="AdamW's decoupled weight decay, on weight matrices "
                                "only (not norms, biases, or embeddings unless embedding_weight_decay).")
    grad_clip: float = Field(default=1.0, ge=0, description="Max gradient norm (0 = no clipping).")


class Schedule(SpecModel):
    """One LR schedule spanning every stage, so a WSD or multi-step run can be extended without restarting."""

    kind: Literal["wsd", "cosine", "multistep", "constant"] = Field(
        default="wsd", description="After warmup, wsd holds the LR then decays it linearly; cosine decays it along "
                                   "a cosine; multistep multiplies it by gamma at each milestone; constant holds it.")
    warmup_steps: int = Field(default=0, ge=0, description="Optimizer steps of linear warmup to the peak LR "
                                                           "(0 = none).")
    decay_fraction: float = Field(
        default=0.1, gt=0, le=1, description="wsd: share of all steps spent decaying (when no stage says decay)."
    )
    min_lr_ratio: float = Field(default=0.0, ge=0, le=1,
                                description="wsd and cosine: the LR the decay ends at, as a fraction of the peak.")
    milestones: list[float] = Field(
        default_factory=list, description="multistep: fractions of all steps where the LR is multiplied by gamma."
    )
    gamma: float = Field(default=0.316, gt=0, le=1,
                         description="multistep: the factor the LR is multiplied by at each milestone.")


class PretrainStage(SpecModel):
    """A stage: a token budget over a data mixture at one sequence length."""

    name: str = Field(max_length=NAME_MAX, pattern=r"^[a-z][a-z0-9_]*$",
                      description="Stage name; its step is pretrain:<name>.")
    tokens: PositiveFloat = Field(le=MAX_TOKENS, description="Token budget of the stage (e.g. 8e12).")
    sequence_length: PositiveInt = Field(description="Tokens per packed training sequence.")
    global_batch_size: PositiveInt = Field(description="Sequences per optimizer step, over all replicas.")
    mixture: dict[str, float] = Field(min_length=1, description="Source name -> sampling weight; sums to 1.")
    schedule_segment: Literal["auto", "stable", "decay"] = Field(
        default="auto", description="wsd: 'decay' marks the stage(s) the LR decays in."
    )
    reset_optimizer: bool = Field(default=False, description="Start the stage with fresh optimizer state.")


MonitorAction = Literal["warn", "rollback", "stop"]


class SpikeMonitor(SpecModel):
    """Sudden loss spike: above the recent mean by `sigma` standard deviations (usually a bad batch)."""

    sigma: PositiveFloat = Field(default=6.0, description="Standard deviations above the recent mean loss that "
                                                          "make a spike (it must also exceed the mean by 5%).")
    window: PositiveInt = Field(default=50, description="Recent steps whose losses give the mean and deviation "
                                                        "(checked from min(10, window) steps on).")
    action: MonitorAction = Field(
        default="rollback", description="warn: report it; rollback: restore the newest checkpoint and skip the "
                                        "batches since (at most max_rollbacks times); stop: end training.")


class DivergenceMonitor(SpecModel):
    """NaN or infinite loss or gradient norm."""

    action: Literal["rollback", "stop"] = Field(
        default="rollback", description="rollback: restore the newest checkpoint and skip the batches since "
                                        "(at most max_rollbacks times); stop: end training.")


class TrendMonitor(SpecModel):
    """Slow rise (LR too high) or plateau (time for a change of data or schedule) over a window of steps."""

    window: PositiveInt = Field(default=200, description="Optimizer steps looked at: the mean loss of their second "
                                                         "half is compared with that of the first.")
    threshold: PositiveFloat = Field(
        default=0.02, description="Relative change of that mean (0.02 = 2%): a slow rise is more than this, a plateau "
                                  "less in either direction.")
    action: Literal["warn", "stop"] = Field(default="warn", description="warn: report it once; stop: end training.")


class ThroughputMonitor(SpecModel):
    """Tokens/s below `ratio` x the median so far: dataloader, then communication, then kernels."""

    ratio: float = Field(default=0.5, gt=0, lt=1, description="Fires when the mean tokens/s of the last few "
                         "steps falls below this fraction of the median of the steps before.")
    window: PositiveInt = Field(default=20, description="Steps measured before the check starts (the recent mean "
                                                        "covers at most 5 of them).")
    action: Literal["warn", "stop"] = Field(default="warn", description="warn: report it once; stop: end training.")


class Monitors(SpecModel):
    """Checks of training health at every optimizer step, each with its likely cause, remedy and action (also used
    by ablations, long context and mid-training)."""

    spike: SpikeMonitor | None = Field(default=SpikeMonitor(), description="Sudden loss spikes (None: off).")
    divergence: DivergenceMonitor = Field(
        default=DivergenceMonitor(), description="Non-finite loss or gradient norm (always checked).")
    slow_rise: TrendMonitor | None = Field(
        default=TrendMonitor(), description="A slowly rising loss, likely an LR too high (None: off).")
    plateau: TrendMonitor | None = Field(
        default=TrendMonitor(window=400, threshold=0.002),
        description="A loss that stopped improving (None: off).")
    throughput: ThroughputMonitor | None = Field(
        default=ThroughputMonitor(), description="A drop in tokens/s, with the part of the step that grew (None: off).")
    max_rollbacks: int = Field(default=3, ge=0, description="Then stop: repeated rollbacks mean a deeper problem.")


class Pretraining(SpecModel):
    """Training from random weights (or continuing what.model) in stages, with one optimizer and one LR schedule
    across them."""

    seed: int = Field(default=1234, description="Seed of the weight initialisation and the data order; long context, "
                                                "mid-training and post-training use it too.")
    monitors: Monitors = Field(default=Monitors(), description="Training-health checks and what each one does.")
    optimizer: Optimizer = Field(
        default=Optimizer(), description="AdamW settings, shared by ablations, long context and mid-training.")
    schedule: Schedule = Field(default=Schedule(), description="The LR schedule across all stages (ablation runs "
                                                               "use it too).")
    intra_document_masking: bool = Field(
        default=True, description="Tokens attend only within their own document of a packed sequence (positions "
                                  "restart at each document); false: across the whole sequence.")
    stages: list[PretrainStage] = Field(
        default_factory=list, description="At least one from random weights; none to fine-tune what.model.init_from.")


class Yarn(SpecModel):
    """Inference-time scaling written into the exported config (beyond the trained length)."""

    kind: Literal["yarn", "linear"] = Field(default="yarn", description="The RoPE scaling type written as "
                                                                      "rope_type.")
    factor: PositiveFloat = Field(
        default=2.0, description="Multiple of the trained length the exported config allows "
                                 "(max_position_embeddings).")


class LongContextStage(SpecModel):
    """A context-extension stage: a longer sequence length and a larger RoPE base."""

    name: str = Field(max_length=NAME_MAX, pattern=r"^[a-z][a-z0-9_]*$",
                      description="Stage name; its step is long_context:<name>.")
    sequence_length: PositiveInt = Field(description="Tokens per training sequence, longer than the context before.")
    rope_theta: PositiveFloat = Field(description="RoPE base frequency of the stage and its exported model, larger "
                                                  "than the one before.")
    tokens: PositiveFloat = Field(le=MAX_TOKENS, description="Token budget of the stage.")
    global_batch_size: PositiveInt = Field(description="Sequences per optimizer step, over all replicas.")
    mixture: dict[str, float] = Field(min_length=1, description="Source name -> sampling weight; sums to 1.")
    micro_batch_size: PositiveInt | None = Field(
        default=None, description="Overrides how.parallelism.micro_batch_size: long sequences need smaller ones."
    )
    lr: PositiveFloat = Field(default=2e-5, description="Peak learning rate of the stage.")
    schedule: Literal["wsd", "cosine", "constant"] = Field(
        default="wsd", description="The stage's own LR schedule (wsd and cosine decay to zero).")
    warmup_steps: int = Field(default=0, ge=0, description="Optimizer steps of linear warmup at the stage's start.")
    decay_fraction: float = Field(default=0.1, gt=0, le=1, description="wsd: share of the stage's steps spent "
                                                                       "decaying to zero.")


class LongContext(SpecModel):
    """Context extension after pretraining (or from what.model), and the passkey retrieval evaluation that checks
    it."""

    stages: list[LongContextStage] = Field(
        default_factory=list, description="Extension stages in order, each continuing the model before it.")
    inference_scaling: Yarn | None = Field(
        default=None, description="RoPE scaling for lengths beyond the trained one, written into the exported "
                                  "config (None: none).")
    retrieval_depths: list[float] = Field(default_factory=lambda: [0.1, 0.5, 0.9],
                                          description="Needle depths of the passkey retrieval evaluation (0-1).")
    retrieval_samples: PositiveInt = Field(default=10, description="Passkey prompts per (length, depth).")
    retrieval_source: str | None = Field(
        default=None, description="Source whose held-out text is the haystack (default: the first stage's "
                                  "most weighted source).")


def pretraining_rules(pt: Pretraining, at: Loc = ("what", "pretraining")) -> Iterator[Issue]:
    """Rules inside what.pretraining: the schedule's fields against its kind and the stages' segments."""
    sched = pt.schedule
    segments = [s.schedule_segment for s in pt.stages]
    total_steps = sum(max(1, int(s.tokens // (s.global_batch_size * s.sequence_length))) for s in pt.stages)
    if sched.kind != "wsd" and any(seg != "auto" for seg in segments):
        i = next(i for i, seg in enumerate(segments) if seg != "auto")
        yield Issue((*at, "stages", i, "schedule_segment"),
                    f"schedule_segment only applies to wsd, not {sched.kind}", "remove it or use kind: wsd")
    if "decay" in segments:
        first = segments.index("decay")
        if any(seg != "decay" for seg in segments[first:]):
            yield Issue((*at, "stages", first, "schedule_segment"),
                        "only the last stages may decay: a stable stage follows a decay stage",
                        "mark every stage after the first decay stage as decay")
    if pt.stages and sched.warmup_steps >= total_steps:
        yield Issue((*at, "schedule", "warmup_steps"),
                    f"warmup_steps={sched.warmup_steps} covers the whole run ({total_steps} steps)",
                    "shorten the warmup (SmolLM3 warmed up for 2,000 steps)")
    if sched.kind == "multistep":
        m = sched.milestones
        if not m:
            yield Issue((*at, "schedule", "milestones"), "multistep needs milestones",
                        "e.g. milestones: [0.8, 0.9]")
        if any(not 0 < x < 1 for x in m) or m != sorted(m):
            yield Issue((*at, "schedule", "milestones"),
                        "milestones must be increasing fractions between 0 and 1", "e.g. [0.8, 0.9]")
    elif sched.milestones:
        yield Issue((*at, "schedule", "milestones"), f"milestones do not apply to {sched.kind}",
                    "remove them or use kind: multistep")
    at = (*at, "schedule")
    yield from unused(sched, "gamma", at, sched.kind == "multistep", "only multistep multiplies the LR by gamma")
    yield from unused(sched, "decay_fraction", at, sched.kind == "wsd", "only wsd decays by a fraction")
    yield from unused(sched, "min_lr_ratio", at, sched.kind in ("wsd", "cosine"), f"{sched.kind} never decays")
