"""Typed wiring between steps: a step names the steps it reads with StepRefs held in its kind's `Inputs` class, not
with role strings and step-id f-strings.

An `Inputs` class is a frozen dataclass whose fields say what each input is: a `StepRef` (one step), an optional
one, or a mapping of names to StepRefs (one role per entry: `tokens:<source>`). `roles()` flattens it into the
role -> step id mapping that the fingerprint, the manifest and the runner read, under the same role names as
before typed wiring, so no committed artifact changes identity.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import ClassVar


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
class Inputs:
    """Base of every kind's typed inputs. A mapping field's roles are `<prefix><key>`; the prefix is the field's
    name and a colon unless the class names another in `prefixes` (compare's runs keep their historic roles)."""

    prefixes: ClassVar[Mapping[str, str]] = {}

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


@dataclass(frozen=True)
class NoInputs(Inputs):
    """A step that reads no other step (ingest, a gate)."""
