"""Shared base for every spec model: unknown keys are errors, so a typo never passes silently."""

from __future__ import annotations

from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict

Loc = tuple[str | int, ...]


class SpecModel(BaseModel):
    """Strict, immutable spec node."""

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=False, validate_default=True)


class HintedError(ValueError):
    """A problem found while checking a spec, with what to do about it (shown after the message)."""

    def __init__(self, message: str, hint: str):
        super().__init__(message)
        self.hint = hint


@dataclass(frozen=True)
class Issue:
    """A problem at a place in the spec (`loc`: keys and list indexes from the top), located to a line later."""

    loc: Loc
    message: str
    hint: str = ""
