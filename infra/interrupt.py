"""Ending a run at once on SIGTERM or Ctrl-C.

Prefect turns SIGTERM into `TerminationSignal` (Ctrl-C is `KeyboardInterrupt`) in the main thread, but its
engine then waits for the step threads to finish before it records anything, so a training step kept the
process alive, and the run "Running", until the step ended and committed. Nothing needs the step to finish:
every committed artifact is already durable (commits are atomic, the manifest last) and the step in flight
resumes from its last checkpoint on the next run. So compass records the final state itself (Cancelled when
the server asked for the cancellation, else Crashed, for the flow run and its running steps), sends the
buffered logs, ends the processes the steps started, and exits with the signal's conventional status.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
from collections.abc import Callable
from typing import Any, NoReturn

import psutil

log = logging.getLogger("compass")
_on_stop: dict[int, Callable[[], None]] = {}  # work started outside this process (Slurm jobs) to end with the run
_lock = threading.Lock()


def on_stop(action: Callable[[], None]) -> int:
    """Run `action` when the run is stopped (SIGTERM, Ctrl-C, a cancellation); returns a handle to remove it."""
    with _lock:
        handle = id(action)
        _on_stop[handle] = action
        return handle


def remove_on_stop(handle: int) -> None:
    with _lock:
        _on_stop.pop(handle, None)


def _run_on_stop() -> None:
    with _lock:
        actions = list(_on_stop.values())
        _on_stop.clear()
    for action in actions:
        with contextlib.suppress(Exception):
            action()


def exit_code(exc: BaseException) -> int:
    return 130 if isinstance(exc, KeyboardInterrupt) else 143


def stop_run(exc: BaseException) -> NoReturn:
    """Record the run as ended, end what it started, and exit now (called in the flow's main thread)."""
    reason = (f"interrupted ({type(exc).__name__}): committed steps are kept; the step in flight commits "
              "nothing and resumes from its last checkpoint on the next run")
    log.warning(reason)
    _run_on_stop()
    with contextlib.suppress(Exception):
        record_final_states(reason)
    with contextlib.suppress(Exception):
        from prefect.logging.handlers import APILogWorker

        APILogWorker.drain_all(timeout=5)
    end_children()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    os._exit(exit_code(exc))


def record_final_states(reason: str) -> None:
    """This flow run Cancelled (if a cancellation was asked for) or Crashed, and its running task runs Crashed."""
    from prefect.client.orchestration import get_client
    from prefect.context import FlowRunContext

    ctx = FlowRunContext.get()
    if ctx is None or ctx.flow_run is None:
        return
    with get_client(sync_client=True) as client:
        end_flow_run(client, ctx.flow_run.id, reason)


def end_flow_run(client: Any, run_id: Any, reason: str) -> None:
    """Through a sync Prefect client: the flow run's running task runs Crashed, then the flow run Cancelled if a
    cancellation was asked for, else Crashed."""
    from prefect.client.schemas.filters import FlowRunFilter, TaskRunFilter
    from prefect.states import Cancelled, Crashed

    running = client.read_task_runs(flow_run_filter=FlowRunFilter(id={"any_": [run_id]}),
                                    task_run_filter=TaskRunFilter(state={"type": {"any_": ["RUNNING", "PENDING"]}}))
    for task_run in running:
        client.set_task_run_state(task_run.id, Crashed(message=reason), force=True)
    current = client.read_flow_run(run_id).state
    final = Cancelled(message=reason) if current is not None and current.is_cancelling() else Crashed(
        message=reason)
    client.set_flow_run_state(run_id, final, force=True)


def end_children(timeout: float = 5.0) -> None:
    """Terminate every process this one started (training launchers, data workers, an embedded server)."""

    children = psutil.Process().children(recursive=True)
    for child in children:
        with contextlib.suppress(psutil.NoSuchProcess):
            child.terminate()
    _, alive = psutil.wait_procs(children, timeout=timeout)
    for child in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            child.kill()
