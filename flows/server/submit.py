"""Submitting a validated spec as a flow run of a deployment, and following it until it ends.

The spec is validated on the submitter's machine first, so a bad spec never reaches the server; the run gets
the spec's text and hash, and the flow refuses a text that does not match the hash.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import datetime
from typing import Any
from uuid import UUID

from prefect.client.schemas.objects import FlowRun

from compass.infra.redact import without_userinfo
from compass.specs.loader import load_spec_text

FINAL_STATES = {"COMPLETED", "FAILED", "CRASHED", "CANCELLED"}


def ui_url(flow_run_id: UUID | str) -> str:
    """The flow run's page in the Prefect UI (from PREFECT_UI_URL, derived from PREFECT_API_URL)."""
    from prefect.settings import PREFECT_API_URL, PREFECT_UI_URL

    base = PREFECT_UI_URL.value() or (PREFECT_API_URL.value() or "").removesuffix("/api")
    return f"{without_userinfo(base).rstrip('/')}/runs/flow-run/{flow_run_id}"


def submit(loaded: Any, spec_path: str, deployment: str, store_root: str | None,
           until: list[str] | None = None) -> FlowRun:
    """Create a flow run of `deployment` for the loaded spec; returns at once (the worker picks it up). A spec
    loaded at smoke or rehearsal size goes as its text, with `smoke` or `rehearse` set: the flow shrinks it again.
    `store_root` None: the run writes the worker's --store, else the spec's own root."""
    from prefect.deployments import run_deployment


    text_hash = load_spec_text(loaded.text, spec_path, loaded.base_dir).spec_hash if loaded.size != "full" else None
    parameters: dict[str, Any] = {"spec_yaml": loaded.text, "spec_path": spec_path,
                                  "base_dir": str(loaded.base_dir), "store_root": store_root,
                                  "spec_hash": text_hash or loaded.spec_hash}
    if until:
        parameters["until"] = until
    if loaded.size != "full":
        parameters["smoke" if loaded.size == "smoke" else "rehearse"] = True
    return run_deployment(deployment, parameters=parameters, timeout=0,
                          flow_run_name=f"{loaded.spec.name}-{loaded.spec_hash[:8]}",
                          tags=[f"spec:{loaded.spec.name}"])


def watch(flow_run_id: UUID, emit: Callable[[str], None], poll_seconds: float = 2.0) -> FlowRun:
    """Print the run's state changes and logs (its task runs' included) until it reaches a final state."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId, LogFilterTimestamp
    from prefect.client.schemas.sorting import LogSort

    last_state = None
    since: datetime | None = None
    seen: set[UUID] = set()
    with get_client(sync_client=True) as client:
        while True:
            run = client.read_flow_run(flow_run_id)
            logs = client.read_logs(
                log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id]),
                                     timestamp=LogFilterTimestamp(after_=since) if since else None),
                sort=LogSort.TIMESTAMP_ASC, limit=200)
            for log in logs:
                if log.id not in seen:
                    seen.add(log.id)
                    emit(f"{log.timestamp:%H:%M:%S} {log.message}")
                since = log.timestamp
            state = run.state.type.value if run.state else "PENDING"
            if state != last_state:
                emit(f"state: {run.state.name if run.state else state}")
                last_state = state
            if state in FINAL_STATES and len(logs) < 200:
                return run
            if len(logs) < 200:
                time.sleep(poll_seconds)
