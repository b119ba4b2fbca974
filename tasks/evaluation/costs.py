"""What each evaluate step costs at the spec's size: the checkpoints it scores, the tokens one checkpoint's scoring
reads (every benchmark request, the held-out sequences, the passkey haystacks) and the time that takes on the
evaluation phase's devices, held against its jobs' time limit. A checkpoint is the unit of progress: its scores are
kept as soon as it is scored (tasks/evaluation/scored.py) and a job asked to stop ends between two checkpoints, so
one checkpoint's scoring must fit in a job, with the stop signal's lead to spare; the step's checkpoints then take
as many jobs as they need."""

from __future__ import annotations

import math
from dataclasses import dataclass

from compass.model.training.heldout_sample import SAMPLE_TOKENS
from compass.specs.costs import count_parameters, flops_per_token, planning_vocab, reached_context, stage_costs
from compass.specs.goodput_plan import exported_every, predicted_splits
from compass.specs.how import slurm_seconds
from compass.specs.post_training import MidTraining
from compass.specs.spec import TrainingSpec
from compass.specs.staging_costs import token_bytes
from compass.tasks.evaluation.offline_benchmarks import request_tokens

HELDOUT_SEQUENCES = 16  # held-out sequences scored per source and checkpoint (model/training/heldout.py)


def heldout_sample_bytes(vocab: int) -> int:
    """Bytes of one source's held-out sample an evaluate step reads (its tokens; a shard's boundary adds up to a
    shard): the same at any corpus size (model/training/heldout_sample.py)."""
    return SAMPLE_TOKENS * token_bytes(vocab)
REQUEST_CONTEXT = 1024  # a benchmark request's length for its attention FLOPs: a question, its choices, few shots


@dataclass(frozen=True)
class EvaluationCost:
    """One evaluate step at the spec's size."""

    step: str  # evaluate:<kind>-<name>
    checkpoints: int  # scored: each kept export, the last being the final weights
    tokens: float  # read by one checkpoint's scoring
    startup_s: float  # a job's start-up: scheduling, imports, the benchmarks' data
    load_s: float  # one checkpoint's weights read from the store
    score_s: float  # one checkpoint's scoring
    limit_s: float | None  # the evaluation phase's job time limit (None: no limit)
    stop_lead_s: float  # how long before the limit a job is asked to stop (how.orchestration.cluster.signal_before_s)
    unestimated: tuple[str, ...] = ()  # benchmarks whose requests the model cannot count (lighteval's own tasks)

    @property
    def per_checkpoint_s(self) -> float:
        return self.load_s + self.score_s

    @property
    def total_s(self) -> float:
        """Every checkpoint, in as many jobs as the time limit asks (each with its start-up)."""
        return self.jobs * self.startup_s + self.checkpoints * self.per_checkpoint_s

    @property
    def jobs(self) -> int:
        usable = self.usable_s
        if usable is None or usable <= 0:
            return 1
        per_job = max(1, int(usable // self.per_checkpoint_s)) if self.per_checkpoint_s > 0 else self.checkpoints
        return max(1, math.ceil(self.checkpoints / per_job))

    @property
    def usable_s(self) -> float | None:
        """A job's time for scoring: its limit less its start-up and the stop signal's lead."""
        return None if self.limit_s is None else self.limit_s - self.startup_s - self.stop_lead_s

    @property
    def fits(self) -> bool:
        return self.usable_s is None or self.per_checkpoint_s <= self.usable_s


def _scored_models(spec: TrainingSpec) -> list[tuple[str, int, int]]:
    """(model step, exported checkpoints, sequence length) of every model step an evaluate step scores."""
    how = spec.how
    export_every = exported_every(spec)
    exports = {split.stage: math.ceil(split.checkpoints / export_every) for split in predicted_splits(spec)}
    out = [(f"{c.section}:{c.name}", exports.get(f"{c.section}:{c.name}", 1) if how.evaluation.every_checkpoint
            else 1, c.seq_len) for c in stage_costs(spec)]
    context = reached_context(spec)
    out += [(f"post_train:{p.name}", 1, context) for p in spec.what.post_training if not isinstance(p, MidTraining)]
    return out


def evaluation_costs(spec: TrainingSpec) -> list[EvaluationCost]:
    """Each evaluate step's cost: forward FLOPs (2N per token plus causal attention at the model's length) at
    how.evaluation.assumed_mfu of the evaluation devices' peak; the benchmarks spread over the phase's ranks
    (lighteval data-parallel), the held-out losses and passkey retrieval on one."""
    ev, how = spec.what.evaluation, spec.how
    if not (ev.benchmarks or ev.perplexity_sources):
        return []
    shape = how.shape("evaluation")
    ranks = max(1, shape.ranks)
    rate = how.hardware.peak * 1e12 * how.evaluation.assumed_mfu  # FLOP/s of one device
    vocab = planning_vocab(spec)
    arch = spec.what.architecture
    weights = count_parameters(arch, vocab).total * 2  # bf16, as exported
    counted = {b.key: request_tokens(b) for b in ev.benchmarks}
    unestimated = tuple(k for k, v in counted.items() if v is None)
    bench_tokens = sum(v for v in counted.values() if v is not None)
    lc = spec.what.long_context
    limit = slurm_seconds(shape.time_limit) if shape.time_limit else None
    request_forward = flops_per_token(arch, vocab, REQUEST_CONTEXT) / 3
    out = []
    for model, checkpoints, seq in _scored_models(spec):
        heldout = len(ev.perplexity_sources) * HELDOUT_SEQUENCES * seq
        passkey = 0.0
        if lc.stages:
            lengths = [spec.what.trained_length, *(s.sequence_length for s in lc.stages)]
            passkey = sum(n * len(lc.retrieval_depths) * lc.retrieval_samples for n in lengths)
        forward = flops_per_token(arch, vocab, seq) / 3  # a forward: a third of training's 6N + attention
        score_s = (bench_tokens * request_forward / ranks + (heldout + passkey) * forward) / rate
        kind, name = model.split(":", 1)
        out.append(EvaluationCost(
            step=f"evaluate:{kind}-{name}", checkpoints=checkpoints, tokens=bench_tokens + heldout + passkey,
            startup_s=how.hardware.startup_estimate_s, load_s=weights / (how.hardware.checkpoint_write_gbps * 1e9),
            score_s=score_s, limit_s=limit, stop_lead_s=how.stop_lead_s,
            unestimated=unestimated))
    return out
