"""Recent lifecycle runs on the Prefect server: state, the step they are on, where they write."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

LIFECYCLE_FLOW = "compass-lifecycle"


@dataclass(frozen=True)
class RunRow:
    id: str
    name: str
    state: str
    started: str
    current_step: str
    steps_done: int
    store: str
    deployment: str

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def recent_runs(limit: int = 10) -> list[RunRow]:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowFilter, FlowFilterName, FlowRunFilter, FlowRunFilterId
    from prefect.client.schemas.sorting import FlowRunSort

    with get_client(sync_client=True) as client:
        runs = client.read_flow_runs(flow_filter=FlowFilter(name=FlowFilterName(any_=[LIFECYCLE_FLOW])),
                                     sort=FlowRunSort.START_TIME_DESC, limit=limit)
        deployments = {d.id: d.name for d in client.read_deployments()} if runs else {}
        rows = []
        for run in runs:
            tasks = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[run.id])))
            rows.append(RunRow(
                id=str(run.id), name=run.name, state=run.state.name if run.state else "Pending",
                started=f"{run.start_time:%Y-%m-%d %H:%M:%S}" if run.start_time else "-",
                current_step=_current_step(tasks),
                steps_done=sum(t.state_type is not None and t.state_type.value == "COMPLETED" for t in tasks),
                store=str(run.parameters.get("store_root") or "-"),
                deployment=deployments.get(run.deployment_id, "-") if run.deployment_id else "-"))
        return rows


def _current_step(tasks: list[Any]) -> str:
    """The running steps, else the one that failed, else the last to finish."""
    running = sorted(t.name for t in tasks if t.state_type and t.state_type.value in {"RUNNING", "PENDING"})
    if running:
        return ", ".join(running)
    failed = [t for t in tasks if t.state_type and t.state_type.value in {"FAILED", "CRASHED"}]
    if failed:
        return f"{failed[0].name} (failed)"
    ended = [t for t in tasks if t.end_time]
    return max(ended, key=lambda t: t.end_time).name if ended else "-"
