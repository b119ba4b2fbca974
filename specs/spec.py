"""The whole training spec: why / what / how."""

from pydantic import Field

from specs.ablation import Ablations
from specs.architecture import Architecture
from specs.base import SpecModel
from specs.data import Data
from specs.evaluation import Evaluation
from specs.how import How
from specs.post_training import PostTrainStep
from specs.tokenizer import Tokenizer
from specs.training import LongContext, Pretraining
from specs.why import Why


class What(SpecModel):
    """Everything that determines the trained model: architecture, tokenizer, data and the phases."""

    architecture: Architecture
    tokenizer: Tokenizer
    data: Data
    ablations: Ablations | None = None
    pretraining: Pretraining
    long_context: LongContext = LongContext()
    post_training: list[PostTrainStep] = Field(default_factory=list)
    evaluation: Evaluation = Evaluation()


class TrainingSpec(SpecModel):
    """A training compass: why train, what to train, how to train it."""

    name: str = Field(pattern=r"^[a-z0-9][a-z0-9_-]*$", description="Run name, used in flow run names.")
    description: str = ""
    why: Why
    what: What
    how: How = How()
