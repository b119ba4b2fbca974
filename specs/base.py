"""Shared base for every spec model: unknown keys are errors, so a typo never passes silently."""

from pydantic import BaseModel, ConfigDict


class SpecModel(BaseModel):
    """Strict, immutable spec node."""

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=False, validate_default=True)
