"""Which `how` fields are part of a step's identity: the classification each `how` model declares beside its
fields (`field_identity`: results, numerics or placement; see specs/how.py), read by dotted path."""

from __future__ import annotations

import typing
from functools import cache
from typing import Any

from pydantic import BaseModel

from compass.specs.how import How, Identity


def _section(annotation: Any) -> type[BaseModel] | None:
    """The `how` model a field holds (directly or as `Model | None`), or None for a value."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    models = [a for a in typing.get_args(annotation) if isinstance(a, type) and issubclass(a, BaseModel)]
    return models[0] if models else None


@cache
def classification(root: type[BaseModel] = How) -> dict[str, Identity]:
    """Every `how` leaf by dotted path (`parallelism.zero_stage`, `resources.data.nodes`), with its class; a leaf
    its model does not classify raises, so a new field cannot enter `how` unclassified."""
    out: dict[str, Identity] = {}

    def visit(model: type[BaseModel], prefix: str) -> None:
        declared: dict[str, Identity] = getattr(model, "field_identity", {})
        for name, info in model.model_fields.items():
            path = f"{prefix}{name}"
            section = _section(info.annotation)
            if section is not None:
                visit(section, f"{path}.")
            elif name in declared:
                out[path] = declared[name]
            else:
                raise TypeError(f"how.{path} is not classified: add it to {model.__name__}.field_identity "
                                "(results, numerics or placement)")
        for name, identity in declared.items():  # derived values (properties) a kind may read instead of fields
            if name not in model.model_fields:
                out[f"{prefix}{name}"] = identity

    visit(root, "")
    return out


def identity_of(path: str) -> Identity:
    """The class of the `how` field at `path`; a path that names no classified field raises ValueError."""
    try:
        return classification()[path]
    except KeyError:
        raise ValueError(f"how.{path} is not a classified how field") from None


def value_at(how: How, path: str) -> Any:
    """The value at a dotted path (a section left unset reads as None), JSON-shaped for fingerprints."""
    value: Any = how
    for part in path.split("."):
        if value is None:
            return None
        value = getattr(value, part)
    return value.model_dump(mode="json") if isinstance(value, BaseModel) else value
