"""What each phase of the run grows to at the spec's size, beside each limit it is held against: the Slurm jobs a
step takes under its time limit, what each node copies onto local disk, what the step reads of what it continues,
writes in checkpoints and commits, what it uploads to an S3 store, and what the orchestrator publishes while it
runs. The same quantities a run's resource ledgers count (infra/resource_ledger.py), so `compass plan` and `compass
status` can be read side by side; every number here is from the spec alone (the planner's models: specs/costs.py,
specs/goodput_plan.py, specs/staging_costs.py, tasks/evaluation/costs.py)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from compass.flows.live import PLOT_POINTS, RECENT_ROWS
from compass.specs.costs import PHASE_OF_SECTION, count_parameters, planning_vocab
from compass.specs.goodput_plan import exported_every, predicted_splits
from compass.specs.how import slurm_seconds
from compass.specs.spec import TrainingSpec
from compass.specs.staging_costs import staging_costs
from compass.tasks.evaluation.costs import evaluation_costs, heldout_sample_bytes

OPTIMIZER_BYTES = 8  # AdamW's two fp32 moments a parameter
MASTER_BYTES = 4  # the fp32 master weights of 16-bit training


@dataclass(frozen=True)
class PhaseScale:
    """One step at the spec's size (bytes and seconds)."""

    step: str
    wall_s: float
    jobs: int  # Slurm jobs (each time limit's requeue and each expected interruption a job); 1 without a limit
    limit_s: float | None  # its jobs' time limit
    staged_per_node: float  # copied onto each node's local disk (0: nothing staged)
    read: float  # taken from the store: what it continues, or the weights and held-out samples it scores
    checkpoint_bytes: float  # training state written over the step (checkpoints x the whole state)
    artifact_bytes: float  # committed: the final state and export, the kept exports (evaluation scores)
    uploaded: float  # to an S3 store: the checkpoint mirror and the artifact (0 on a shared file system)
    fits_job: bool  # a job's usable time holds one unit of progress (a checkpoint interval, a scored checkpoint)

    @property
    def progress_s(self) -> float:
        """Wall time per job (the whole step when it takes one)."""
        return self.wall_s / max(1, self.jobs)


def _state_bytes(spec: TrainingSpec) -> tuple[float, float]:
    """(the whole training state, one Hugging Face export) in bytes."""
    params = count_parameters(spec.what.architecture, planning_vocab(spec)).total
    weight = 4 if spec.how.precision == "fp32" else 2
    master = 0 if spec.how.precision == "fp32" else MASTER_BYTES
    return params * (weight + master + OPTIMIZER_BYTES), params * weight


def phase_scales(spec: TrainingSpec) -> list[PhaseScale]:
    """Every training stage and evaluate step of the spec."""
    how = spec.how
    remote = (how.storage.root or "").startswith("s3://")
    state, export = _state_bytes(spec)
    staged = {c.step: c.per_node for c in staging_costs(spec)}
    export_every = exported_every(spec)
    lead = how.stop_lead_s
    out: list[PhaseScale] = []
    previous: str | None = None
    for split in predicted_splits(spec):
        section = split.stage.split(":", 1)[0]
        shape = how.shape(PHASE_OF_SECTION[section])
        limit = slurm_seconds(shape.time_limit) if shape.time_limit else None  # a time limit is a cluster's
        usable = None if limit is None else limit - how.hardware.startup_estimate_s - lead
        jobs = 1 + math.ceil(split.interruptions)
        if usable is not None and usable > 0:
            jobs = max(1, math.ceil(split.total_s / usable)) + math.ceil(split.interruptions)
        exports = math.ceil(split.checkpoints / export_every)
        kept = exports if how.evaluation.every_checkpoint else min(exports, how.checkpoints.keep_last)
        interval = split.compute_s / max(1, split.checkpoints)
        # with a requeue the stop signal saves a checkpoint at the limit; without one a job must reach the next
        # (specs/checks._checkpoint_cadence refuses what does not fit)
        fits = usable is None or (usable > 0 and (lead > 0 or interval <= usable))  # lead: the requeue's signal
        continues = previous is not None or spec.what.model is not None
        checkpoints = split.checkpoints * state
        artifact = state + export + kept * export
        out.append(PhaseScale(step=split.stage, wall_s=split.total_s, jobs=jobs, limit_s=limit,
                              staged_per_node=staged.get(split.stage, 0.0),
                              read=state + export if continues else 0.0, checkpoint_bytes=checkpoints,
                              artifact_bytes=artifact, uploaded=checkpoints + artifact if remote else 0.0,
                              fits_job=fits))
        previous = split.stage
    sample = heldout_sample_bytes(planning_vocab(spec)) * len(spec.what.evaluation.perplexity_sources)
    for cost in evaluation_costs(spec):
        out.append(PhaseScale(step=cost.step, wall_s=cost.total_s, jobs=cost.jobs, limit_s=cost.limit_s,
                              staged_per_node=0.0, read=cost.checkpoints * export + sample, checkpoint_bytes=0.0,
                              artifact_bytes=0.0, uploaded=0.0, fits_job=cost.fits))
    return out


def orchestrator_note(spec: TrainingSpec) -> str:
    """What the orchestrating process keeps and publishes per training step, whatever the run's length."""
    mon = spec.how.monitoring
    return (f"the orchestrator follows each running stage in at most {PLOT_POINTS + RECENT_ROWS:,} rows of its "
            f"history (read as written, never again), updates one progress artifact every "
            f"{mon.progress_every_s:g} s and publishes a plot every {mon.plot_every_s:g} s "
            f"({86400 / mon.plot_every_s:,.0f} a day): flat in the steps")

