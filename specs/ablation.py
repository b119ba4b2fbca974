"""`what.ablations`: a baseline and variants that each change exactly one thing."""

from typing import Any

from pydantic import Field, PositiveFloat, PositiveInt

from compass.specs.base import NAME_MAX, SpecModel
from compass.specs.limits import MAX_TOKENS


class AblationBaseline(SpecModel):
    """A cheap stand-in for the main run: a proxy model (architecture overrides) and/or fewer tokens."""

    architecture: dict[str, Any] = Field(
        default_factory=dict, description="Overrides of what.architecture for a proxy model (empty = target size)."
    )
    tokens: PositiveFloat = Field(le=MAX_TOKENS, description="Token budget of each ablation run.")
    sequence_length: PositiveInt = Field(description="Tokens per training sequence.")
    global_batch_size: PositiveInt = Field(description="Sequences per optimizer step, over all replicas.")
    mixture: dict[str, float] = Field(min_length=1, description="Source name -> sampling weight; sums to 1.")
    lr: PositiveFloat | None = Field(default=None,
                                     description="Peak learning rate (None: what.pretraining.optimizer.lr).")


class AblationVariant(SpecModel):
    """One change against the baseline, as a dotted path (e.g. architecture.tied_embeddings) and value."""

    name: str = Field(max_length=NAME_MAX, pattern=r"^[a-z][a-z0-9_]*$",
                      description="Variant name; its runs are the steps ablate:<name>-s<seed>.")
    change: dict[str, Any] = Field(
        min_length=1, description="Exactly one dotted field of the baseline and its new value, e.g. "
                                  "{architecture.tied_embeddings: false}.")


class Ablations(SpecModel):
    """Short proxy runs: the baseline and each variant trained once per seed with the pretraining optimizer,
    schedule and monitors, then compared metric by metric against the seed noise."""

    baseline: AblationBaseline = Field(description="The proxy run every variant is compared against.")
    variants: list[AblationVariant] = Field(min_length=1, description="The changes to try, one field each.")
    seeds: list[int] = Field(
        default_factory=lambda: [0], min_length=1,
        description="Each run is repeated once per seed (weights and data order); a variant is better or worse "
                    "only when the 95% interval of its difference from the baseline, paired by seed, excludes 0. "
                    "One seed gives no noise estimate, and its verdicts say so.")
    metrics: list[str] = Field(
        default_factory=lambda: ["val_loss"], min_length=1,
        description="Metrics compared; the first decides the verdict: val_loss, val_loss:<source>, or a benchmark "
                    "metric of what.evaluation.benchmarks as `<task key>/<metric>` (e.g. arc_easy:cf/acc).")
    higher_is_better: dict[str, bool] = Field(
        default_factory=dict, description="Direction per metric where the default is wrong (losses and perplexities "
                                          "lower, everything else higher).")
    probes: int = Field(default=0, ge=0, le=10, description="Benchmark evaluations at evenly spaced points of each "
                        "run besides its end: whether a change helps shows before the loss says so.")

    def lower_is_better(self, metric: str) -> bool:
        if metric in self.higher_is_better:
            return not self.higher_is_better[metric]
        return "loss" in metric or "ppl" in metric
