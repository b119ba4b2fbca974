"""The whole run's time left, said after each step: the plan's model of each step's time (training stages and
ablations from their FLOPs at the spec's hardware, evaluations from their tokens: specs/goodput_plan.py,
specs/costs.py, tasks/evaluation/costs.py) corrected by what the run measured (the steps that ran took `ratio` times
their predictions), along the longest chain of steps still to end: steps that run side by side do not add up."""

from __future__ import annotations

from dataclasses import dataclass

from compass.flows.compiler import Plan
from compass.flows.reports.progress import duration
from compass.flows.reports.step_record import StepRecord
from compass.specs.costs import ablation_cost
from compass.specs.goodput_plan import predicted_splits
from compass.specs.spec import TrainingSpec
from compass.tasks.evaluation.costs import evaluation_costs


def predicted_seconds(spec: TrainingSpec, plan: Plan) -> dict[str, float]:
    """Each step the model times, by id: its wall time at the spec's size and hardware."""
    out = {split.stage: split.total_s for split in predicted_splits(spec)}
    out |= {cost.step: cost.total_s for cost in evaluation_costs(spec)}
    ablations = ablation_cost(spec)
    if ablations is not None and ablations.runs:
        each = ablations.gpu_hours / ablations.runs / max(1, ablations.gpus) * 3600
        out |= {s.id: each for s in plan.steps if s.kind == "ablate"}
    return {step: seconds for step, seconds in out.items() if step in plan.fingerprints}


@dataclass(frozen=True)
class RunClock:
    plan: Plan
    predicted: dict[str, float]  # the model's seconds by step id (steps it cannot time are absent)

    def ratio(self, results: list[StepRecord]) -> float | None:
        """Measured over predicted, over the steps this run computed that the model times (None: none yet)."""
        timed = [r for r in results if r.executed and r.step in self.predicted and self.predicted[r.step] > 0]
        predicted = sum(self.predicted[r.step] for r in timed)
        return sum(r.seconds for r in timed) / predicted if predicted > 0 else None

    def left_s(self, results: list[StepRecord]) -> float:
        """The longest chain of steps not yet ended, each at its prediction x the measured ratio; a step the
        model does not time at the mean time of those of its kind (else of all the steps) this run computed."""
        ended = {r.step for r in results}
        ratio = self.ratio(results) or 1.0
        computed = [r for r in results if r.executed]
        by_kind: dict[str, list[float]] = {}
        for r in computed:
            by_kind.setdefault(r.kind, []).append(r.seconds)
        overall = sum(r.seconds for r in computed) / len(computed) if computed else 0.0
        finish: dict[str, float] = {}
        for step in self.plan.steps:  # in dependency order
            if step.id in ended:
                finish[step.id] = 0.0
                continue
            if step.id in self.predicted:
                own = self.predicted[step.id] * ratio
            else:
                seen = by_kind.get(step.kind)
                own = sum(seen) / len(seen) if seen else overall
            finish[step.id] = own + max((finish.get(d, 0.0) for d in step.needs), default=0.0)
        return max(finish.values(), default=0.0)

    def line(self, results: list[StepRecord]) -> str:
        """`; about 3h10m left in the run (the plan's model x 0.84, measured)`; empty once every step ended."""
        if len(results) >= len(self.plan.steps):
            return ""
        ratio = self.ratio(results)
        basis = "the plan's model" if ratio is None else f"the plan's model x {ratio:.2g}, measured"
        return f"; about {duration(self.left_s(results))} left in the run ({basis})"
