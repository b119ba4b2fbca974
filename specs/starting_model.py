"""`what.model`: start from an existing Hugging Face checkpoint instead of random weights (continued pretraining,
mid-training, long context or post-training only). Its architecture and tokenizer come with it."""

from pydantic import Field, PositiveInt

from compass.specs.base import SpecModel


class ResolvedCheckpoint(SpecModel):
    """What compass read from the checkpoint when it loaded the spec (never written by hand): it pins the step's
    identity, so a checkpoint replaced under the same name trains again instead of reusing a stale artifact."""

    location: str = Field(description="The folder, s3:// URI or hf://repo it was read from (not part of identity).")
    stamp: str = Field(description="Hub snapshot commit, or a digest of the files' names, sizes and dates/ETags.")
    model_type: str = Field(description="The checkpoint's config.json model_type (e.g. llama, qwen3).")
    context_length: PositiveInt = Field(description="The length the checkpoint was trained at (RoPE scaling aside).")
    parameters: PositiveInt | None = Field(default=None, description="Counted from config.json, for the plan's "
                                           "memory per GPU (None when compass cannot count its kind).")


class StartingModel(SpecModel):
    """A Hugging Face checkpoint that is not trained by this run: where it is and at which revision."""

    init_from: str = Field(min_length=1, description="Hub id (from the local Hugging Face cache: nothing downloads), "
                                                     "a folder (relative to the spec) or an s3:// URI.")
    revision: str | None = Field(default=None, description="Hub ids only: a branch, tag or commit of the cache.")
    resolved: ResolvedCheckpoint | None = Field(default=None, description="Filled in by compass on loading.")


MODEL_NAME = r"^[a-z0-9][a-z0-9._-]*$"
NAMED_MODEL_PREFIX = "model:"  # how strong, weak and teacher name an entry of what.models
