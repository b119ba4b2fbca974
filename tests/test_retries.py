"""Prefect's retries, proven on the server: a step that fails once with a fault succeeds on its retry, and the task
run's state history shows the retry and the completed second run; a data error is not retried."""

from __future__ import annotations

from pathlib import Path

import pytest

from compass.infra.errors import DataError
from compass.tasks.steps import registry
from compass.tasks.steps.context import StepContext, StepResult
from compass.tasks.steps.kind import PlanBuilder, StepKind
from compass.tasks.steps.step_config import StepConfig
from tests.conftest import prefect_client, settled_task_runs, write_minimal_spec

pytestmark = pytest.mark.slow


class FlakyConfig(StepConfig):
    """Fail the first run (leaving `marker` behind), succeed once `marker` exists."""

    marker: str
    fault: str


def _build(plan: PlanBuilder) -> None:
    marker = Path.cwd() / "flaky-ran-once"
    plan.add(FLAKY, "once", FlakyConfig(marker=str(marker), fault="connection"))
    plan.add(FLAKY, "bad-data", FlakyConfig(marker=str(marker.with_name("bad-data-ran")), fault="data"))


def _run(ctx: StepContext[FlakyConfig]) -> StepResult:
    marker = Path(ctx.config.marker)
    if ctx.config.fault == "data":
        marker.write_text(str(int(marker.read_text()) + 1) if marker.exists() else "1")
        raise DataError("the source has a malformed record (the same every time)")
    if not marker.exists():
        marker.write_text("failed once")
        raise ConnectionError("the store went away mid-write")
    return StepResult(metrics={"attempt": 2}, summary="### flaky\n\nsucceeded on its retry")


FLAKY = StepKind("flaky", FlakyConfig, _run, _build, version="1")


@pytest.fixture
def flaky():
    registry.register(FLAKY)
    yield FLAKY
    registry.unregister(FLAKY.name)


def test_a_fault_is_retried_on_the_server_and_a_data_error_is_not(flaky, prefect_server: str, tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch):
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterName
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from compass.flows.lifecycle import lifecycle

    spec = write_minimal_spec(tmp_path, **{"how:\n": "how:\n  orchestration: {retries: 2, retry_delay_seconds: 0}\n"})
    monkeypatch.chdir(tmp_path)
    with temporary_settings({PREFECT_API_URL: prefect_server}), pytest.raises(DataError):  # bad-data fails the run
        lifecycle.with_options(flow_run_name="flaky-step")(
            spec_yaml=spec.read_text(), spec_path=str(spec), base_dir=str(tmp_path), store_root=str(tmp_path / "st"),
            until=["flaky"])
    with prefect_client(prefect_server) as client:
        (run,) = client.read_flow_runs(flow_run_filter=FlowRunFilter(name=FlowRunFilterName(any_=["flaky-step"])))
    tasks = settled_task_runs(prefect_server, run.id, {"flaky:once", "flaky:bad-data"})
    with prefect_client(prefect_server) as client:
        states = {name: sorted(client.read_task_run_states(t.id), key=lambda s: s.timestamp)
                  for name, t in tasks.items()}
    history = {name: [s.name for s in run_states] for name, run_states in states.items()}
    once = history["flaky:once"]
    assert once == ["Pending", "Running", "Retrying", "Completed"] and tasks["flaky:once"].run_count == 2, once
    assert (tmp_path / "flaky-ran-once").read_text() == "failed once"
    bad = history["flaky:bad-data"]
    assert bad[-1] == "Failed" and "AwaitingRetry" not in bad and tasks["flaky:bad-data"].run_count == 1, bad
    assert (tmp_path / "bad-data-ran").read_text() == "1"  # ran once with two retries to spare
