"""What the decontamination fence covers, read from the spec: which sources and post-training steps train, and
whether training steps read the fence (`remove`) or only wait for its verdict. Shared by the fence's kind
(tasks/kinds/decontaminate.py) and the kinds that read it under `remove` (tokenize, post-training)."""

from __future__ import annotations

from compass.specs.post_training import MidTraining, PostTrainStep
from compass.specs.spec import TrainingSpec
from compass.tasks.steps.kind import PlanBuilder
from compass.tasks.steps.wiring import StepRef

FENCE_KIND, FENCE_INDEX_KIND, FENCE_NAME = "decontaminate", "fence_index", "benchmarks"
INDEX_FOLDER = "index"  # the fence artifact's index: what `remove` matches against


def trained_sources(spec: TrainingSpec) -> list[str]:
    """Every source a training mixture names: pretraining, long-context and ablation mixtures, mid-training."""
    what = spec.what
    names = {s for stage in what.pretraining.stages for s in stage.mixture}
    names |= {s for stage in what.long_context.stages for s in stage.mixture}
    names |= set(what.ablations.baseline.mixture) if what.ablations else set()
    names |= {p.dataset for p in what.post_training if isinstance(p, MidTraining)}
    return sorted(names)


def fenced_post_training(spec: TrainingSpec) -> list[PostTrainStep]:
    """The post-training steps whose drawn examples the fence scans (mid-training reads a curated source)."""
    return [p for p in spec.what.post_training if not isinstance(p, MidTraining)]


def needs_fence(spec: TrainingSpec) -> bool:
    """A fence is planned when something is evaluated on benchmarks and something trains on data."""
    return bool(spec.what.evaluation.benchmarks) and bool(trained_sources(spec) or fenced_post_training(spec))


def fence_read_by(plan: PlanBuilder) -> StepRef | None:
    """The fence's index a training step's data passes through under `remove` (None: the step only waits for the
    fence's verdict, or there is no fence). Only the benchmarks and n make the index: a post-training change
    re-runs the scan, never the tokenization it does not touch."""
    if needs_fence(plan.spec) and plan.spec.what.decontamination.policy == "remove":
        return plan.require(FENCE_INDEX_KIND, FENCE_NAME)
    return None
