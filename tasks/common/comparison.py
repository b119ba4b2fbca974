"""What the ablations' comparison step writes (`comparison.json`) and what reads it (`compass ablate promote`, the
reports): one typed record, so neither side reads the other's keys."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

Direction = Literal["lower", "higher"]


class ComparedVariant(BaseModel):
    """One row: a variant's mean of the comparison's metric over its seeds, its difference from the baseline and
    the verdict (the baseline's row is the first, verdict "reference"). The other metrics' columns ride along as
    extra fields (`<metric>`, `<metric> delta`, `<metric> verdict`)."""

    model_config = ConfigDict(extra="allow", frozen=True, populate_by_name=True)

    variant: str
    verdict: str
    delta: float
    change: str = ""
    runs: int = 0
    seed_std: float = Field(default=0.0, alias="seed std")
    interval: list[float] | None = Field(default=None, alias="delta 95% interval")


class Comparison(BaseModel):
    """The comparison of every variant with the baseline on `metric` (the first of `metrics`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    metric: str
    metrics: list[str] = Field(default_factory=list)
    better_is: dict[str, Direction] = Field(default_factory=dict)
    rows: list[ComparedVariant]

    def direction(self, metric: str | None = None) -> Direction:
        """Which way the metric is better (recorded; losses and perplexities are lower-better where it is not)."""
        name = metric or self.metric
        return self.better_is.get(name, "lower" if any(w in name for w in ("loss", "ppl")) else "higher")

    def better(self) -> list[ComparedVariant]:
        """The variants judged better than the baseline beyond the seed noise."""
        return [r for r in self.rows[1:] if r.verdict == "better"]

    def json_text(self) -> str:
        return self.model_dump_json(by_alias=True, exclude_none=False, indent=2)
