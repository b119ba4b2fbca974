"""One step of a lifecycle run as the flow's Prefect task returns it, and as every report of the run reads it."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from compass.infra.resource_ledger import Resources


class StepRecord(BaseModel):
    """One step of the run: committed at `uri`, computed by this run (`executed`) or found cached."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    step: str
    uri: str
    executed: bool
    seconds: float
    pid: int
    # what this process spent on the step: computing it (in-process), or submitting and following its job (the
    # job's own ledger is in the manifest): artifacts published, CPU, peak memory
    orchestrator: Resources | None = None

    @property
    def kind(self) -> str:
        return self.step.split(":", 1)[0]
