"""Shared base for every spec model: unknown keys are errors, so a typo never passes silently."""

from pydantic import BaseModel, ConfigDict


class SpecModel(BaseModel):
    """Strict, immutable spec node."""

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=False, validate_default=True)


class HintedError(ValueError):
    """A problem found while checking a spec, with what to do about it (shown after the message)."""

    def __init__(self, message: str, hint: str):
        super().__init__(message)
        self.hint = hint
