"""The typed slice of the spec that one step reads, the base of every kind's config.

Its own module so that what only needs the config's type (placement's resources, the step context) need not import
the kinds' framework (tasks/steps/kind.py), which imports them.
"""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict


class StepConfig(BaseModel):
    """The slice of the spec one step reads. Its canonical JSON (with the inputs' fingerprints and the kind's
    code version) is the step's identity, so it holds what changes the output and nothing else."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    omit_when_none: ClassVar[frozenset[str]] = frozenset()  # optional parts left out of the identity when unset

    def identity(self) -> dict[str, Any]:
        data = self.model_dump(mode="json")
        for key in self.omit_when_none:
            if data.get(key) is None:
                data.pop(key, None)
        return data

    def sets_how(self) -> frozenset[str]:
        """`how` paths this step's own config overrides (a long-context stage's micro_batch_size): its kind reads
        them from `how` no longer, so they leave its identity."""
        return frozenset()


class EmptyConfig(StepConfig):
    """A step whose output depends on its inputs only."""
