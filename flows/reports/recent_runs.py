"""Recent lifecycle runs on the Prefect server: state, the step they are on, where they write."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import Any

from pydantic import ValidationError

from compass.flows.reports.run_outcome import Criterion, Verdict
from compass.infra import resource_ledger
from compass.infra.resource_ledger import Resources, size_text
from compass.model.training.records import CAUSES, GOODPUT_TABLE, GoodputSplit, cause_label, summed

LIFECYCLE_FLOW = "compass-lifecycle"
SUCCESS_TABLE = "success"  # the report step's table of criteria (tasks/kinds/success_report.py)


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
    goodput: GoodputSplit | None = None  # the run's training, post-training and evaluation steps, summed
    goodput_steps: int = 0  # how many steps it sums (those that ran in this run, not the cached)
    resources: Resources | None = None  # the resource ledgers of the steps that ran in this run, summed
    resources_steps: int = 0
    verdict: Verdict | None = None  # its success report's, once the run reached it

    def verdict_cell(self) -> str:
        """`MET: 2 of 2 pass`, or `-` before (or without) a success report."""
        return self.verdict.headline() if self.verdict else "-"

    def as_dict(self) -> dict[str, Any]:
        return asdict(self) | {"goodput": self.goodput.model_dump(mode="json") if self.goodput else None,
                               "resources": self.resources.row() if self.resources else None,
                               "verdict": self.verdict.model_dump(mode="json") if self.verdict else None}

    def resources_cell(self) -> str:
        """`read 1.2 GiB, wrote 3.4 GiB, up 3.4 GiB`: the bytes the run's steps moved."""
        if self.resources is None:
            return "-"
        r = self.resources
        return (f"read {size_text(r.read)}, copied {size_text(r.copied)}, wrote {size_text(r.written)}, "
                f"up {size_text(r.uploaded)}")

    def goodput_cell(self) -> str:
        """`81% (start-up 9%), 4 steps`: the share of the time spent computing and the largest badput."""
        if self.goodput is None:
            return "-"
        g = self.goodput
        cause = max(CAUSES, key=lambda c: getattr(g, f"{c}_s"))
        share = getattr(g, f"{cause}_s") / g.total_s if g.total_s > 0 else 0.0
        return (f"{g.goodput:.0%}" + (f" ({cause_label(cause)} {share:.0%})" if share >= 0.005 else "")
                + f", {self.goodput_steps} step{'s' * (self.goodput_steps != 1)}")


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
            splits = _goodput_splits(client, run.id)
            ledgers = _resource_ledgers(client, run.id)
            rows.append(RunRow(
                id=str(run.id), name=run.name, state=run.state.name if run.state else "Pending",
                started=f"{run.start_time:%Y-%m-%d %H:%M:%S}" if run.start_time else "-",
                current_step=_current_step(tasks),
                steps_done=sum(t.state_type is not None and t.state_type.value == "COMPLETED" for t in tasks),
                store=str(run.parameters.get("store_root") or ("the worker's" if run.deployment_id else "-")),
                deployment=deployments.get(run.deployment_id, "-") if run.deployment_id else "-",
                goodput=summed(splits), goodput_steps=len(splits),
                resources=_summed(ledgers), resources_steps=len(ledgers), verdict=_verdict(client, run.id)))
        return rows


def run_verdict(run_id: Any) -> Verdict | None:
    """The success report's verdict of one flow run (what `compass submit --watch` ends with)."""
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        return _verdict(client, run_id)


def _verdict(client: Any, run_id: Any) -> Verdict | None:
    """From the run's `success` table artifact (the report step's criteria, published cached or not)."""
    criteria = []
    for row in _tables(client, run_id, SUCCESS_TABLE):
        if {"criterion", "checkpoint", "verdict"} <= row.keys():
            with contextlib.suppress(ValidationError):
                criteria.append(Criterion.model_validate(row))
    if not criteria:
        return None
    return Verdict(passed=all(c.verdict == "pass" for c in criteria), criteria=tuple(criteria), report="")


def _goodput_splits(client: Any, run_id: Any) -> list[GoodputSplit]:
    """The splits the run's steps published (their `goodput` table artifacts: only steps that ran publish one)."""
    splits = []
    for row in _tables(client, run_id, GOODPUT_TABLE):
        if {"total_s", "compute_s"} <= row.keys():
            with contextlib.suppress(ValidationError):
                splits.append(GoodputSplit.model_validate({k: v for k, v in row.items() if k != "goodput"}))
    return splits


def _tables(client: Any, run_id: Any, word: str) -> Iterator[dict[str, Any]]:
    """The rows of the run's table artifacts whose key holds `-word-` (`<spec>-goodput-<step>`)."""
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId, ArtifactFilterKey

    yield from _table_rows(client.read_artifacts(artifact_filter=ArtifactFilter(
        flow_run_id=ArtifactFilterFlowRunId(any_=[run_id]), key=ArtifactFilterKey(like_=f"%-{word}-%"))))


def _table_rows(artifacts: list[Any]) -> Iterator[dict[str, Any]]:
    """The rows of the table artifacts among `artifacts`: a key filter also matches other artifacts whose key holds
    the same word (a spec named `probe_goodput_test` makes markdown artifacts `probe-goodput-test-...`), and those,
    or a row of another shape, are passed over, never fatal to `compass status`."""
    for artifact in artifacts:
        if getattr(artifact, "type", None) != "table":
            continue
        try:
            rows = json.loads(artifact.data) if isinstance(artifact.data, str) else artifact.data
        except ValueError:
            continue
        yield from (row for row in rows if isinstance(row, dict)) if isinstance(rows, list) else ()


def _resource_ledgers(client: Any, run_id: Any) -> list[Resources]:
    """The ledgers the run's steps published (their `resources` table artifacts: only steps that ran publish one)."""
    ledgers = []
    for row in _tables(client, run_id, resource_ledger.TABLE):
        if "written" in row:
            with contextlib.suppress(ValidationError):
                ledgers.append(Resources.model_validate(row))
    return ledgers


def _summed(ledgers: list[Resources]) -> Resources | None:
    total = None
    for ledger in ledgers:
        total = ledger if total is None else total.merged(ledger)
    return total


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
