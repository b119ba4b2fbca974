"""`why`: the reason to train and the success criteria that decide whether the run achieved it."""

import operator
from typing import Annotated, Literal

from pydantic import Field

from compass.specs.base import SpecModel


class SuccessCriterion(SpecModel):
    """A metric threshold on a named checkpoint, checked by the final evaluation."""

    metric: str = Field(min_length=1, description="Evaluation metric, e.g. 'arc_easy:cf/acc' or 'val_ppl:web'.")
    op: Literal[">=", ">", "<=", "<"] = Field(
        default=">=", description="How the measured value must compare with threshold for the criterion to pass.")
    threshold: float = Field(description="The value the measured metric is compared with.")
    checkpoint: str = Field(
        default="final", description="'final', or a step such as 'pretrain:stage2' or 'post_train:sft'."
    )

    def met_by(self, value: float) -> bool:
        """Whether a measured value passes (the gate and the success report judge alike)."""
        return _COMPARE[self.op](value, self.threshold)


_COMPARE = {">=": operator.ge, ">": operator.gt, "<=": operator.le, "<": operator.lt}


class _WhyBase(SpecModel):
    success_criteria: list[SuccessCriterion] = Field(
        min_length=1, description="What must be true at the end for the run to have achieved its goal."
    )
    override: str | None = Field(
        default=None, min_length=20, max_length=2000,
        description="Why to train even though an existing model already meets the criteria (the gate then lets the "
                    "run go on; the reason lands in the success report).")


class ResearchWhy(_WhyBase):
    """A research question worth a training run, with the hypothesis the run tests."""

    reason: Literal["research"]
    question: str = Field(min_length=10, description="The research question the run answers.")
    hypothesis: str = Field(min_length=10, description="What you expect, stated so the run can refute it.")


class ExistingModelTried(SpecModel):
    """An existing model the production need could use instead: compass evaluates it on the spec's benchmarks
    before any training (the gate). `metric`, `score` and `required` record what its authors measured."""

    model: str = Field(min_length=1, description="Hub id (from the local Hugging Face cache), folder or s3:// URI.")
    metric: str | None = Field(default=None, description="The metric its authors report (recorded only: the gate "
                                                         "measures the spec's own benchmarks).")
    score: float | None = Field(default=None, description="Its authors' score on that metric (recorded only).")
    required: float | None = Field(default=None, description="The score the production need requires.")


class ProductionWhy(_WhyBase):
    """A production need (domain or deployment constraint) that existing models measurably fail."""

    reason: Literal["production"]
    need: str = Field(min_length=10, description="Domain specificity or deployment constraint.")
    existing_models: list[ExistingModelTried] = Field(
        min_length=1, description="Existing models that might already do: each is evaluated by the gate.")


class OpenSourceWhy(_WhyBase):
    """A strategic gap in the open ecosystem that this model fills."""

    reason: Literal["open_source"]
    gap: str = Field(min_length=10, description="The gap in open models this run fills.")


Why = Annotated[ResearchWhy | ProductionWhy | OpenSourceWhy, Field(discriminator="reason")]
