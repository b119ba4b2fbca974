"""Typed wiring between steps: a step names the steps it reads with StepRefs held in its kind's `Inputs` class, not
with role strings and step-id f-strings.

An `Inputs` class is a frozen dataclass whose fields say what each input is: a `StepRef` (one step), an optional
one, or a mapping of names to StepRefs (one role per entry: `tokens:<source>`). `roles()` flattens it into the
role -> step id mapping that the fingerprint, the manifest and the runner read, under the same role names as
before typed wiring, so no committed artifact changes identity. When the step runs, `given()` reads the same class
back from the committed artifacts by role: an executor asks `ctx.given(TrainingInputs).previous`, not
`ctx.inputs["previous"]`. The classes are generic in what an input is (R): a StepRef while the plan is built, the
committed artifact while the step runs.
"""

from __future__ import annotations

import types
from collections.abc import Mapping
from dataclasses import MISSING, dataclass, fields
from typing import Any, ClassVar, Generic, Self, TypeVar, Union, get_args, get_origin, get_type_hints

R = TypeVar("R")  # what an input is: a StepRef while the plan is built, the committed artifact while the step runs


@dataclass(frozen=True, order=True)
class StepRef:
    """One step of the plan, by kind and name (what a builder hands to another step's Inputs)."""

    kind: str
    name: str

    @property
    def id(self) -> str:
        return f"{self.kind}:{self.name}"

    @classmethod
    def parse(cls, step_id: str) -> StepRef:
        kind, sep, name = step_id.partition(":")
        if not sep or not kind or not name:
            raise ValueError(f"not a step id (kind:name): {step_id!r}")
        return cls(kind, name)

    def __str__(self) -> str:
        return self.id


@dataclass(frozen=True)
class Inputs(Generic[R]):
    """Base of every kind's typed inputs. A mapping field's roles are `<prefix><key>`; the prefix is the field's
    name and a colon unless the class names another in `prefixes` (compare's runs keep their historic roles)."""

    prefixes: ClassVar[Mapping[str, str]] = {}

    @classmethod
    def given(cls, artifacts: Mapping[str, Any]) -> Self:
        """The inputs as the step runs: each field holds the committed artifact of the role `roles()` gave it (a
        mapping field, those of its prefix by key; an optional one, None when the plan gave none)."""
        hints = get_type_hints(cls)
        scalars = {f.name for f in fields(cls) if get_origin(hints[f.name]) is not Mapping}
        values: dict[str, Any] = {}
        for f in fields(cls):
            if f.name not in scalars:
                prefix = cls.prefixes.get(f.name, f"{f.name}:")
                values[f.name] = {role[len(prefix):]: art for role, art in artifacts.items()
                                  if role.startswith(prefix) and role not in scalars}
            elif f.name in artifacts:
                values[f.name] = artifacts[f.name]
            elif _optional(hints[f.name]) and f.default is not MISSING:
                values[f.name] = None
            else:
                raise KeyError(f"{cls.__name__}.{f.name}: the step was given no input '{f.name}' (given: "
                               f"{', '.join(sorted(artifacts)) or 'none'})")
        return cls(**values)

    def roles(self) -> dict[str, str]:
        """role -> step id, in field order: what the fingerprint and the runner read."""
        out: dict[str, str] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if value is None:
                continue
            if isinstance(value, StepRef):
                out[f.name] = value.id
            elif isinstance(value, Mapping):
                prefix = self.prefixes.get(f.name, f"{f.name}:")
                for key, ref in value.items():
                    if not isinstance(ref, StepRef):
                        raise TypeError(f"{type(self).__name__}.{f.name}[{key!r}] is a {type(ref).__name__}, "
                                        "not a StepRef")
                    out[f"{prefix}{key}"] = ref.id
            else:
                raise TypeError(f"{type(self).__name__}.{f.name} is a {type(value).__name__}: an input is a "
                                "StepRef, None or a mapping of StepRefs")
        return out


def _optional(hint: Any) -> bool:
    return get_origin(hint) in (Union, types.UnionType) and type(None) in get_args(hint)


@dataclass(frozen=True)
class NoInputs(Inputs):
    """A step that reads no other step (ingest, a gate)."""
