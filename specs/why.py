"""`why`: the reason to train and the success criteria that decide whether the run achieved it."""

from typing import Annotated, Literal

from pydantic import Field

from compass.specs.base import SpecModel


class SuccessCriterion(SpecModel):
    """A metric threshold on a named checkpoint, checked by the final evaluation."""

    metric: str = Field(min_length=1, description="Evaluation metric, e.g. 'arc_easy:cf/acc' or 'val_ppl:web'.")
    op: Literal[">=", ">", "<=", "<"] = ">="
    threshold: float
    checkpoint: str = Field(
        default="final", description="'final', or a step such as 'pretrain:stage2' or 'post_train:sft'."
    )


class _WhyBase(SpecModel):
    success_criteria: list[SuccessCriterion] = Field(
        min_length=1, description="What must be true at the end for the run to have achieved its goal."
    )


class ResearchWhy(_WhyBase):
    """A research question worth a training run, with the hypothesis the run tests."""

    reason: Literal["research"]
    question: str = Field(min_length=10, description="The research question the run answers.")
    hypothesis: str = Field(min_length=10, description="What you expect, stated so the run can refute it.")


class ExistingModelTried(SpecModel):
    """An existing model that was measured on the production need and found wanting."""

    model: str = Field(min_length=1)
    metric: str = Field(min_length=1)
    score: float
    required: float = Field(description="The score the production need requires.")


class ProductionWhy(_WhyBase):
    """A production need (domain or deployment constraint) that existing models measurably fail."""

    reason: Literal["production"]
    need: str = Field(min_length=10, description="Domain specificity or deployment constraint.")
    existing_models: list[ExistingModelTried] = Field(
        min_length=1, description="Existing models tried, each with the measured gap."
    )


class OpenSourceWhy(_WhyBase):
    """A strategic gap in the open ecosystem that this model fills."""

    reason: Literal["open_source"]
    gap: str = Field(min_length=10, description="The gap in open models this run fills.")


Why = Annotated[ResearchWhy | ProductionWhy | OpenSourceWhy, Field(discriminator="reason")]
