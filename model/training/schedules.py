"""Learning-rate schedules that span every stage of a run.

`lr_factor(step)` is a pure function of the global step, so the schedule state in a checkpoint is just the
step, and a WSD run can be extended by adding tokens to its stable stages without touching earlier steps.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from compass.specs.training import PretrainStage, Schedule


@dataclass(frozen=True)
class StageSteps:
    name: str
    steps: int
    segment: str  # auto | stable | decay


@dataclass(frozen=True)
class ScheduleShape:
    kind: str
    warmup_steps: int
    decay_fraction: float
    min_lr_ratio: float
    milestones: tuple[float, ...]
    gamma: float
    stages: tuple[StageSteps, ...]

    @property
    def total_steps(self) -> int:
        return sum(s.steps for s in self.stages)

    def decay_start(self) -> int:
        """WSD: the first decay step: the start of the first 'decay' stage, or the last decay_fraction."""
        start = 0
        for s in self.stages:
            if s.segment == "decay":
                return start
            start += s.steps
        if any(s.segment == "stable" for s in self.stages):
            return self.total_steps  # every stage seen is explicitly stable: no decay among them
        return int(round(self.total_steps * (1 - self.decay_fraction)))

    def lr_factor(self, step: int) -> float:
        """Multiplier of the peak LR at global optimizer step `step` (0-based)."""
        if self.warmup_steps and step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        total, floor = self.total_steps, self.min_lr_ratio
        if self.kind == "constant":
            return 1.0
        if self.kind == "wsd":
            start = self.decay_start()
            if step < start:
                return 1.0
            span = max(1, total - start)
            progress = min(1.0, (step - start + 1) / span)
            return floor + (1 - floor) * (1 - progress)
        if self.kind == "cosine":
            span = max(1, total - self.warmup_steps)
            progress = min(1.0, (step - self.warmup_steps) / span)
            return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))
        if self.kind == "multistep":
            passed = sum(1 for m in self.milestones if step >= m * total)
            return self.gamma**passed
        raise ValueError(f"unknown schedule {self.kind}")


def schedule_shape(schedule: Schedule, stages: Sequence[PretrainStage]) -> ScheduleShape:
    """From the spec's schedule and the stages it spans (token budget, sequence length, global batch)."""
    steps = tuple(StageSteps(s.name, stage_steps(s), s.schedule_segment) for s in stages)
    return ScheduleShape(schedule.kind, schedule.warmup_steps, schedule.decay_fraction, schedule.min_lr_ratio,
                         tuple(schedule.milestones), schedule.gamma, steps)


def stage_steps(stage: PretrainStage) -> int:
    """Optimizer steps of a stage: its token budget in whole global batches (at least one)."""
    return max(1, int(stage.tokens // (stage.global_batch_size * stage.sequence_length)))
