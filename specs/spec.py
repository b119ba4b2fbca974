"""The whole training spec: why / what / how."""

from typing import Annotated

from pydantic import Field, StringConstraints

from compass.specs.ablation import Ablations
from compass.specs.architecture import Architecture
from compass.specs.base import NAME_MAX, SpecModel
from compass.specs.data import Data
from compass.specs.evaluation import Decontamination, Evaluation
from compass.specs.how import How
from compass.specs.post_training import PostTrainStep
from compass.specs.starting_model import MODEL_NAME, StartingModel
from compass.specs.tokenizer import Tokenizer
from compass.specs.training import LongContext, Pretraining
from compass.specs.why import Why


class What(SpecModel):
    """Everything that determines the trained model: architecture, tokenizer, data and the phases. Starting from
    an existing checkpoint (`model.init_from`), the architecture and tokenizer come with it (compass fills
    `architecture` in when the spec loads) and pretraining stages are optional."""

    model: StartingModel | None = Field(
        default=None, description="Start from this existing Hugging Face checkpoint instead of random weights "
        "(None: train from random weights).")
    models: dict[Annotated[str, StringConstraints(max_length=NAME_MAX, pattern=MODEL_NAME)], StartingModel] = Field(
        default_factory=dict, description="Models from outside this run that steps name as 'model:<name>': "
        "strong or weak answerers of preference pairs, distillation teachers (SmolLM3's APO pairs came from "
        "Qwen3-32B against Qwen3-0.6B). Read like what.model (hub cache, folder, s3://) and copied into the store "
        "with their lineage.")
    architecture: Architecture | None = Field(
        default=None, description="The decoder to train; required from random weights, read from the checkpoint's "
        "config.json when `model` is set.")
    tokenizer: Tokenizer | None = Field(
        default=None, description="Tokenizer candidates and the rule that picks one; required from random weights, "
        "refused with `model` (the checkpoint's tokenizer is used).")
    data: Data = Field(default=Data(), description="The raw sources and how each is curated.")
    ablations: Ablations | None = Field(
        default=None, description="Short proxy runs comparing one-field changes against a baseline (None: none).")
    pretraining: Pretraining = Field(
        default=Pretraining(), description="Pretraining stages, optimizer, LR schedule and training monitors.")
    long_context: LongContext = Field(
        default=LongContext(), description="Context-extension stages after pretraining (none by default).")
    post_training: list[PostTrainStep] = Field(
        default_factory=list, description="Post-training steps in order, each starting from the model the one "
                                          "before produced.")
    evaluation: Evaluation = Field(
        default=Evaluation(), description="The benchmarks and perplexities every model step is evaluated on, and "
                                          "the vibe-check prompts.")
    decontamination: Decontamination = Field(
        default=Decontamination(), description="The fence between training data and the benchmarks evaluated: "
                                               "n-gram index, scan of every training source, and the policy.")

    @property
    def trained_length(self) -> int:
        """The context the model has been trained at before long context: the last pretraining stage's, else
        the starting checkpoint's."""
        if self.pretraining.stages:
            return self.pretraining.stages[-1].sequence_length
        if self.model is None or self.model.resolved is None:
            raise ValueError("no pretraining stage and no resolved starting checkpoint: load the spec with "
                             "compass.specs.loader, which reads what.model.init_from")
        return self.model.resolved.context_length


class TrainingSpec(SpecModel):
    """A training compass: why train, what to train, how to train it."""

    name: str = Field(max_length=NAME_MAX, pattern=r"^[a-z0-9][a-z0-9_-]*$",
                      description="Run name, used in flow run names.")
    description: str = Field(default="", description="Free text about the run, for people reading the spec.")
    why: Why = Field(description="Why train: a research question, a production need or an open-source gap, with "
                                 "the success criteria.")
    what: What = Field(description="What to train: the starting point, the data and every training phase.")
    how: How = Field(default=How(), description="How to run it: hardware, parallelism, storage, orchestration and "
                                                "cadences.")
