"""`compass worker`: Prefect's process worker, stopped by one Ctrl-C.

Prefect's own `prefect worker start` answers a first Ctrl-C by ceasing to take runs and then waits for its
threads, which an idle worker never finishes: it kept running until a second Ctrl-C killed it. compass starts that
worker as a child in a session of its own (so the terminal's Ctrl-C reaches compass alone), forwards the first
Ctrl-C or SIGTERM to it, and stops it for good once it has no flow run left: at once when idle; a busy worker
finishes its runs first, and a second Ctrl-C stops those too (their steps resume where their last commit left).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

from compass.infra.die_with_parent import parent_death_preexec

GRACE_S = 3.0  # how long Prefect's own stop may take before an idle worker is stopped for it
POLL_S = 0.2


def flow_runs_of(pid: int) -> list[int]:
    """The flow runs a worker is running: its child processes."""

    try:
        return [child.pid for child in psutil.Process(pid).children()]
    except psutil.NoSuchProcess:
        return []


def serve(pool: str) -> int:
    """Run the process worker on `pool` until it ends or is asked to stop; its exit code."""
    prefect = Path(sys.executable).with_name("prefect")

    worker = subprocess.Popen([str(prefect), "worker", "start", "--pool", pool, "--type", "process"],
                              start_new_session=True, preexec_fn=parent_death_preexec())  # it dies with compass
    asked: list[float] = []  # when each stop was asked

    def ask(signum: int, _frame: object) -> None:
        asked.append(time.monotonic())
        if len(asked) == 1:
            runs = flow_runs_of(worker.pid)
            print(f"compass worker: stopping ({len(runs)} flow run(s) to finish first; Ctrl-C again to stop them too)"
                  if runs else "compass worker: stopping", file=sys.stderr, flush=True)
            os.kill(worker.pid, signal.SIGINT)  # Prefect's graceful stop: no new runs
        else:
            _kill_group(worker.pid)

    signal.signal(signal.SIGINT, ask)
    signal.signal(signal.SIGTERM, ask)
    while worker.poll() is None:
        if asked and time.monotonic() - asked[0] > GRACE_S and not flow_runs_of(worker.pid):
            _kill_group(worker.pid)  # idle, and Prefect's own stop did not end it
        time.sleep(POLL_S)
    return 0 if asked else worker.returncode


def _kill_group(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGKILL)
