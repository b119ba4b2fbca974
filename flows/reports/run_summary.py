"""What a lifecycle run returns, typed on both sides: the run's summary (what `compass run` prints, `--json` writes
and a submitter reads from the flow run's result), its steps' records among it."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from compass.flows.reports.run_outcome import RunOutcome
from compass.flows.reports.step_record import StepRecord


class RunSummary(BaseModel):
    """The run: its steps in the order they ended, what `--until` left out, the outcome, and at smoke or rehearsal
    size what each step exercised and shrank (one row per step)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    spec: str
    store: str
    steps: list[StepRecord]
    left_out: list[str]
    flow_pid: int
    outcome: RunOutcome
    smoke: list[dict[str, str]] | None = None
    rehearsal: list[dict[str, str]] | None = None

    @property
    def ran(self) -> list[StepRecord]:
        return [s for s in self.steps if s.executed]
