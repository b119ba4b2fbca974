"""`what.evaluation`: the lighteval suite every kept checkpoint is scored on."""

from typing import Literal

from pydantic import Field, PositiveInt

from specs.base import SpecModel


class EvalTask(SpecModel):
    """One benchmark in one formulation: cloze (cf) gives early signal, multiple choice (mcf) later."""

    name: str = Field(min_length=1, description="e.g. arc_easy, arc_challenge, hellaswag, piqa, mmlu.")
    formulation: Literal["cf", "mcf"] = "cf"
    fewshot: int = Field(default=0, ge=0)
    limit: PositiveInt | None = Field(default=None, description="Evaluate the first N samples only.")


class Evaluation(SpecModel):
    tasks: list[EvalTask] = Field(default_factory=list)
    perplexity_sources: list[str] = Field(
        default_factory=list, description="Curated sources whose held-out split gives a validation perplexity."
    )
    vibe_prompts: list[str] = Field(default_factory=list, description="Fixed prompts a person reads.")
