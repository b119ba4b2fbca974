"""How sure a benchmark score is: a 95% bootstrap interval of the mean over the benchmark's items, and the verdict
a threshold gets from it. A score of 0.52 on 64 items is 0.40-0.64 give or take; the gate and the success report
call a criterion met or missed only when the whole interval is on one side of its threshold, and say "within
noise" otherwise, instead of comparing two point estimates."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from compass.specs.why import SuccessCriterion
from compass.tasks.evaluation.scores import ItemScore

CONFIDENCE = 0.95
RESAMPLES = 2000
Verdict = Literal["met", "missed", "within noise", "no interval"]


def mean_interval(values: Sequence[float], seed: int = 0) -> tuple[float, float] | None:
    """The percentile bootstrap interval of the mean (seeded: the same items give the same interval). None with
    fewer than two items: one item says nothing of the spread."""
    if len(values) < 2:
        return None
    import numpy as np

    sample = np.asarray(values, dtype=float)
    rng = np.random.default_rng(seed)
    means = sample[rng.integers(0, len(sample), size=(RESAMPLES, len(sample)))].mean(axis=1)
    tail = (1 - CONFIDENCE) / 2 * 100
    low, high = np.percentile(means, [tail, 100 - tail])
    return float(low), float(high)


def item_values(metric: str, items: dict[str, list[ItemScore]]) -> list[float] | None:
    """Each item's value of a criterion's metric (`benchmark:formulation/metric`); None when the metric is not a
    benchmark's (a perplexity, a passkey accuracy) or its items were not kept."""
    benchmark, _, name = metric.partition("/")
    scored = items.get(benchmark)
    if not scored or not all(name in i.metrics for i in scored):
        return None
    return [i.metrics[name] for i in scored]


def criterion_verdict(criterion: SuccessCriterion, interval: tuple[float, float] | None) -> Verdict:
    """Met or missed only when the whole interval is on one side of the threshold."""
    if interval is None:
        return "no interval"
    low, high = interval
    if criterion.met_by(low) and criterion.met_by(high):
        return "met"
    if not criterion.met_by(low) and not criterion.met_by(high):
        return "missed"
    return "within noise"
