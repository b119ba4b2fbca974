"""Shared base for every spec model: unknown keys are errors, so a typo never passes silently; numbers are
finite, so no value turns into `null` in the spec hash (two different specs, one identity) or into a crash."""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from types import UnionType
from typing import Annotated, Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel, ConfigDict, field_validator, model_validator

# A name becomes part of artifact folder names (`<kind>/<name>-<fingerprint>`, evaluation steps join two names):
# capped so those stay well under a file system's 255 bytes per name.
NAME_MAX = 64

Loc = tuple[str | int, ...]


class SpecModel(BaseModel):
    """Strict, immutable spec node."""

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=False, validate_default=True,
                              allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _no_bool_for_a_number(cls, data: Any) -> Any:
        """YAML's true and false are no counts or rates, but pydantic reads `num_layers: true` as 1: a bool where a
        number-only field expects its number is handed on as the word it was written as, which the field refuses
        at its own line ("Input should be a valid integer")."""
        if not isinstance(data, dict):
            return data
        words = {key: str(value).lower() for key, value in data.items() if isinstance(value, bool)
                 and (field := cls.model_fields.get(key)) is not None and _a_number_only(field.annotation)}
        return {**data, **words} if words else data

    @field_validator("*", mode="after")
    @classmethod
    def _finite_inside(cls, value: Any) -> Any:
        """Free-form fields (filter params, ablation changes) hold numbers the float fields' check never sees."""
        where = _non_finite(value)
        if where is not None:
            raise ValueError(f"{where or 'the value'} is not a finite number (.inf and .nan are not allowed)")
        return value


def _a_number_only(annotation: Any) -> bool:
    """Whether a field's type takes numbers (int, float, their constrained forms, optional) and no bool."""
    kinds: set[Any] = set()

    def leaves(t: Any) -> None:
        origin = get_origin(t)
        if origin is Annotated:
            leaves(get_args(t)[0])
        elif origin is Literal:
            kinds.update(type(v) for v in get_args(t))
        elif origin in (Union, UnionType):
            for arg in get_args(t):
                leaves(arg)
        else:
            kinds.add(origin or t)

    leaves(annotation)
    kinds.discard(type(None))
    return bool(kinds) and kinds <= {int, float}


def _non_finite(value: Any, where: str = "") -> str | None:
    """The key path to an infinite or NaN float inside plain dicts and lists, or None."""
    if isinstance(value, float):
        return where if not math.isfinite(value) else None
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list | tuple) else ()
    for key, item in items:
        found = _non_finite(item, f"{where}.{key}" if isinstance(key, str) else f"{where}[{key}]")
        if found is not None:
            return found.lstrip(".")
    return None


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


def unused(model: Any, field: str, loc: Loc, applies: bool, why: str) -> Iterator[Issue]:
    """A field set where it has no effect is refused, never silently ignored."""
    if not applies and field in model.model_fields_set:
        yield Issue((*loc, field), f"{field} has no effect here: {why}", f"remove {field}")


def repeats(names: list[str]) -> list[tuple[int, str]]:
    """(index, name) of every entry whose name appeared earlier: the duplicate, not the original."""
    return [(i, n) for i, n in enumerate(names) if n in names[:i]]
