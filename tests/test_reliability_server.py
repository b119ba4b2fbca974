"""kill -9 of `compass run` leaves no process behind: Prefect's temporary server (a uvicorn subprocess Prefect
stops only through atexit) and the run's helpers are tied to it and end with it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from tests.conftest import REPO, write_minimal_spec

pytestmark = pytest.mark.slow


def _uvicorn(children: list[psutil.Process]) -> list[psutil.Process]:
    out = []
    for child in children:
        try:
            if "uvicorn" in " ".join(child.cmdline()):
                out.append(child)
        except psutil.NoSuchProcess:
            pass
    return out


def test_kill_9_of_compass_run_takes_the_temporary_server_with_it(tmp_path: Path):
    spec = write_minimal_spec(tmp_path)
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}  # the temporary server, not a real one
    env["PREFECT_HOME"] = str(tmp_path / "prefect-home")
    run = subprocess.Popen([sys.executable, "-m", "compass.flows.cli", "run", str(spec), "--store",
                            str(tmp_path / "store")], cwd=REPO, env=env, stdout=subprocess.DEVNULL,
                           stderr=subprocess.PIPE, text=True)
    parent = psutil.Process(run.pid)
    deadline = time.time() + 240
    servers: list[psutil.Process] = []
    while time.time() < deadline and not servers and run.poll() is None:
        servers = _uvicorn(parent.children(recursive=True))
        time.sleep(0.5)
    assert servers, f"no temporary server was started: {run.stderr.read() if run.poll() is not None else ''}"
    time.sleep(8)  # the flow is running steps now
    started = parent.children(recursive=True)
    run.send_signal(signal.SIGKILL)
    run.wait()
    _, alive = psutil.wait_procs(started, timeout=20)
    assert not alive, f"outlived compass: {[(p.pid, p.cmdline()) for p in alive if p.is_running()]}"


def test_a_configured_server_is_left_alone(monkeypatch: pytest.MonkeyPatch):
    from compass.infra.temporary_server import start_tied_temporary_server

    monkeypatch.setenv("PREFECT_API_URL", "http://127.0.0.1:4200/api")
    assert start_tied_temporary_server() is None
