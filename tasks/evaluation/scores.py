"""What lighteval gives a compass step for a set of benchmarks: each benchmark's aggregate metrics, the provenance
of its data, and every item as it was scored. The items are kept so that a verdict can pair two models item by item
(an interval over items, not two point estimates) and so that anyone can recompute a score from the record: the
row of the benchmark's evaluation split, its metric values, each choice's log-likelihood or the generated answer."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

ITEMS = "items.json"  # an evaluation's items as scored, beside its results.json: {benchmark key: [ItemScore]}


class ItemScore(BaseModel):
    """One item of one benchmark as lighteval scored it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    item: str  # the row of the benchmark's prepared evaluation split (lighteval's Doc.id)
    metrics: dict[str, float]
    logprobs: list[float] = Field(default_factory=list)  # each choice's summed log-likelihood (multiple choice)
    answer: str = ""  # the generated text (generative benchmarks)


class BenchmarkScores(BaseModel):
    """lighteval's results for a set of benchmarks, keyed by the benchmark's key (`name:formulation`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    results: dict[str, dict[str, float]] = Field(default_factory=dict)  # lighteval's aggregates, stderr included
    provenance: list[dict[str, Any]] = Field(default_factory=list)
    items: dict[str, list[ItemScore]] = Field(default_factory=dict)
    load_s: float = 0.0  # the rest of lighteval's run: the benchmarks' data, the model's load, collecting results
    score_s: float = 0.0  # lighteval's evaluation proper


def item_score(doc: Any, response: Any, metrics: dict[str, Any]) -> ItemScore:
    """An ItemScore from lighteval's Detail (its Doc, ModelResponse and per-sample metric values)."""
    generative = bool(response.text)  # a loglikelihood response carries no text
    return ItemScore(item=str(doc.id), metrics={k: float(v) for k, v in metrics.items()},
                     logprobs=[] if generative else [float(x) for x in response.logprobs],
                     answer=response.text[0] if generative else "")
