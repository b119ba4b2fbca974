"""The spec reference, generated from the pydantic models: their class docstrings and field descriptions are the
only source, so the reference cannot drift from what the loader accepts. One section per model reached from
`TrainingSpec`, each field with its YAML path, type, default, constraints, description and an example taken from
the shipped example specs (else its default). The documentation site builds it (docs/hooks/spec_reference.py)
and refuses a field without a description."""

from __future__ import annotations

import json
import re
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined
from ruamel.yaml import YAML

from compass.specs.spec import TrainingSpec

EXAMPLES = Path(__file__).resolve().parent / "examples"


@dataclass(frozen=True)
class FieldDoc:
    """One field of one model, as the reference shows it."""

    model: str
    name: str
    paths: tuple[str, ...]  # every YAML path it is reached at (`what.data.sources[].format`)
    type: str
    default: str
    constraints: str
    description: str
    example: str
    identity: str = ""  # a `how` field's class in step identity (results, numerics, placement)


@dataclass(frozen=True)
class ModelDoc:
    name: str
    doc: str
    fields: tuple[FieldDoc, ...]


def _models_in(annotation: Any) -> list[type[BaseModel]]:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in typing.get_args(annotation) for m in _models_in(arg)]


def _child_path(path: str, name: str, annotation: Any) -> str:
    """The path of a field's own sub-models: `[]` for list items, `.<key>` for map values."""
    here = f"{path}.{name}" if path else name
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        for arg in typing.get_args(annotation):
            if arg is not type(None):
                return _child_path(path, name, arg)
    if origin is typing.Annotated:
        return _child_path(path, name, typing.get_args(annotation)[0])
    if origin in (list, tuple):
        return f"{here}[]"
    if origin is dict:
        return f"{here}.<key>"
    return here


def walk(root: type[BaseModel]) -> dict[type[BaseModel], list[tuple[str, str, FieldInfo]]]:
    """Every model reached from `root`, in the order first reached, with (path, name, field) of its fields at every
    place it is reached (the spec's models hold no cycle)."""
    found: dict[type[BaseModel], list[tuple[str, str, FieldInfo]]] = {}

    def visit(model: type[BaseModel], path: str) -> None:
        found.setdefault(model, [])
        for name, info in model.model_fields.items():
            found[model].append((path, name, info))
            for sub in _models_in(info.annotation):
                visit(sub, _child_path(path, name, info.annotation))

    visit(root, "")
    return found


def type_name(annotation: Any) -> str:
    """A type as a spec author reads it: `list of tensorboard | mlflow`, `map of str to float`, `Schedule`."""
    if annotation is type(None):
        return "null"
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return f"[{annotation.__name__}](#{annotation.__name__.lower()})"
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Literal:
        return " \\| ".join(f"`{a}`" for a in args)
    if origin is typing.Annotated:
        return type_name(args[0])
    if origin in (typing.Union, types.UnionType):
        return " \\| ".join(type_name(a) for a in args)
    if origin in (list, tuple):
        inner = [a for a in args if a is not Ellipsis]
        return f"list of {type_name(inner[0])}" if inner else "list"
    if origin is dict:
        return f"map of {type_name(args[0])} to {type_name(args[1])}"
    if isinstance(annotation, type):
        return {"str": "string", "int": "integer", "float": "number", "bool": "boolean"}.get(
            annotation.__name__, annotation.__name__)
    return str(annotation).replace("typing.", "")


def constraints(info: FieldInfo) -> str:
    """The field's bounds, lengths and pattern."""
    out = []
    for meta in info.metadata:
        for attr, symbol in (("gt", ">"), ("ge", ">="), ("lt", "<"), ("le", "<=")):
            value = getattr(meta, attr, None)
            if value is not None:
                out.append(f"{symbol} {value}")
        for attr, label in (("min_length", "at least"), ("max_length", "at most")):
            value = getattr(meta, attr, None)
            if value is not None:
                out.append(f"{label} {value} long")
        pattern = getattr(meta, "pattern", None)
        if pattern:
            out.append(f"matches `{pattern}`")
    return ", ".join(dict.fromkeys(out))


def default_text(info: FieldInfo) -> str:
    if info.default is PydanticUndefined and info.default_factory is None:
        return "required"
    value = info.default_factory() if info.default_factory is not None else info.default  # type: ignore[call-arg]
    if isinstance(value, BaseModel):
        return "its defaults" if value.model_dump(exclude_unset=True) == {} else _short(value.model_dump(mode="json"))
    return _short(value)


def _short(value: Any, limit: int = 60) -> str:
    text = json.dumps(value, default=str)
    return f"`{text if len(text) <= limit else text[:limit - 3] + '...'}`"


def _examples() -> list[tuple[str, Any]]:

    yaml = YAML(typ="safe", pure=True)
    return [(p.name, yaml.load(p.read_text())) for p in sorted(EXAMPLES.glob("*.yaml"))]


def _lookup(data: Any, path: str) -> list[Any]:
    """Every value at a reference path in a loaded YAML document (`[]` fans out over a list, `<key>` over a map)."""
    values = [data]
    for part in re.findall(r"[^.\[\]]+|\[\]", path):
        nxt: list[Any] = []
        for value in values:
            if part == "[]" and isinstance(value, list):
                nxt += value
            elif part == "<key>" and isinstance(value, dict):
                nxt += list(value.values())
            elif isinstance(value, dict) and part in value:
                nxt.append(value[part])
        values = nxt
    return values


def _tags(model: type[BaseModel]) -> dict[str, Any]:
    """A union variant's tag values (`reason: research`): the fields that tell the variants apart."""
    return {name: typing.get_args(info.annotation)[0] for name, info in model.model_fields.items()
            if _is_discriminator(info)}


def example_text(model: type[BaseModel], name: str, paths: tuple[str, ...], examples: list[tuple[str, Any]]) -> str:
    """The field's value in the first shipped spec that sets it, on an object of this variant; else its default."""
    info = model.model_fields[name]
    if _is_discriminator(info):
        return _short(typing.get_args(info.annotation)[0])
    tags = _tags(model)
    for spec_name, data in examples:
        for path in paths:
            parent, _, _ = path.rpartition(".")
            owners = _lookup(data, parent) if parent else [data]
            found = [o[name] for o in owners if isinstance(o, dict) and name in o
                     and all(o.get(k) == v for k, v in tags.items())]
            if found:
                return f"{_short(found[0])} ({spec_name})"
    return default_text(info) if default_text(info) != "required" else ""


def model_docs(root: type[BaseModel] | None = None) -> list[ModelDoc]:
    examples = _examples()
    docs = []
    for model, places in walk(root or _root()).items():
        fields = []
        for name, info in model.model_fields.items():
            paths = tuple(dict.fromkeys(f"{p}.{name}" if p else name for p, n, _ in places if n == name))
            description = " ".join((info.description or "").split())
            if not description and _is_discriminator(info):
                description = "Selects this variant."
            identity = getattr(model, "field_identity", {}).get(name, "")
            fields.append(FieldDoc(model.__name__, name, paths, type_name(info.annotation), default_text(info),
                                   constraints(info), description, example_text(model, name, paths, examples),
                                   identity))
        docs.append(ModelDoc(model.__name__, _doc(model), tuple(fields)))
    return docs


def _doc(model: type[BaseModel]) -> str:
    """The model's own docstring on one line ('' when it has none: pydantic's BaseModel's does not count)."""
    return " ".join((model.__doc__ or "").split()) if model.__doc__ != BaseModel.__doc__ else ""


def _is_discriminator(info: FieldInfo) -> bool:
    return typing.get_origin(info.annotation) is typing.Literal and len(typing.get_args(info.annotation)) == 1


def undocumented(root: type[BaseModel] | None = None) -> list[str]:
    """`Model.field` of every field without a description (a one-value Literal, a union's tag, needs none) and
    `Model` of every model without a docstring."""
    models = walk(root or _root())
    missing = [model.__name__ for model in models if not _doc(model)]
    return missing + [f"{model.__name__}.{name}" for model in models for name, info in model.model_fields.items()
                      if not info.description and not _is_discriminator(info)]


def _root() -> type[BaseModel]:

    return TrainingSpec


def render(root: type[BaseModel] | None = None) -> str:
    """The reference page, in Markdown."""
    lines = ["# Spec reference", "",
             "Every field of a training spec, generated from the models the loader validates with "
             "(`compass.specs`): what you can write, its type, default, bounds and meaning, and an example from "
             "the shipped specs (`specs/examples/`). Unknown keys are errors.", "",
             "Each `how` field has an **identity** class: *results* fields change what a step produces and are part "
             "of the fingerprint of the steps that read them (a change re-runs those steps); *numerics* fields "
             "decide where a step runs and with it the order of floating-point sums: not in the fingerprint, but "
             "`compass plan` says when a reused artifact was made under another value; *placement* fields only "
             "decide where and how a step runs and is watched.", ""]
    for model in model_docs(root):
        lines += [f"## {model.name}", "", model.doc, ""]
        classified = any(f.identity for f in model.fields)
        extra = (" Identity |", "---|") if classified else ("", "")
        lines += ["| Field | Type | Default | Constraints | Description | Example |" + extra[0],
                  "|---|---|---|---|---|---|" + extra[1]]
        for f in model.fields:
            lines.append(f"| {'<br>'.join(f'`{p}`' for p in f.paths)} | {f.type} | {f.default} | {f.constraints} | "
                         f"{_cell(f.description)} | {f.example} |" + (f" {f.identity} |" if classified else ""))
        lines.append("")
    return "\n".join(lines)


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


if __name__ == "__main__":
    print(render())
