"""kill -9 of `compass run` leaves no process behind: Prefect's temporary server (a uvicorn subprocess Prefect
stops only through atexit) and the run's helpers are tied to it and end with it. The flow run it leaves Running in
Prefect's database is marked Crashed by the next run of the same store."""

from __future__ import annotations

import contextlib
import os
import signal
import sqlite3
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
    run = subprocess.Popen([sys.executable, "-m", "compass.flows.cli.app", "run", str(spec), "--store",
                            str(tmp_path / "store")], cwd=REPO, env=env, stdout=subprocess.DEVNULL,
                           stderr=subprocess.PIPE, text=True)
    parent = psutil.Process(run.pid)
    deadline = time.time() + 240
    servers: list[psutil.Process] = []
    while time.time() < deadline and not servers and run.poll() is None:
        servers = _uvicorn(parent.children(recursive=True))
        time.sleep(0.5)
    assert servers, f"no temporary server was started: {run.stderr.read() if run.poll() is not None else ''}"
    database = tmp_path / "prefect-home" / "prefect.db"
    while time.time() < deadline and run.poll() is None and _states(database) != ["RUNNING"]:
        time.sleep(0.5)
    time.sleep(5)  # the flow is running steps now
    assert run.poll() is None, run.stderr.read()[-3000:]
    started = parent.children(recursive=True)
    run.send_signal(signal.SIGKILL)
    run.wait()
    _, alive = psutil.wait_procs(started, timeout=20)
    assert not alive, f"outlived compass: {[(p.pid, p.cmdline()) for p in alive if p.is_running()]}"

    assert _states(database) == ["RUNNING"], _flow_runs(database)  # nothing in the killed process could report
    again = subprocess.run([sys.executable, "-m", "compass.flows.cli.app", "run", str(spec), "--store",
                            str(tmp_path / "store"), "--until", "ingest:notes"], cwd=REPO, env=env,
                           capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr[-3000:]
    killed, latest = _flow_runs(database)
    assert killed[0] == "CRASHED" and f"pid {run.pid}) is gone" in killed[1], killed
    assert latest[0] == "COMPLETED", latest
    assert "left Running by a killed process" in again.stderr and "marked Crashed" in again.stderr
    assert not list((tmp_path / "store" / ".locks" / "runs").iterdir())  # both records gone: one dropped, one ended


def _states(database: Path) -> list[str]:
    return [kind for kind, _ in _flow_runs(database)]


def _flow_runs(database: Path) -> list[tuple[str, str | None]]:
    """(state type, state message) of every flow run in a temporary server's database, oldest first."""
    if not database.exists():
        return []
    with contextlib.closing(sqlite3.connect(database, timeout=30)) as db, \
            contextlib.suppress(sqlite3.OperationalError):  # its tables are not made yet
        return [(kind, message) for kind, message in db.execute(
            "SELECT flow_run.state_type, flow_run_state.message FROM flow_run LEFT JOIN flow_run_state "
            "ON flow_run.state_id = flow_run_state.id ORDER BY flow_run.created")]
    return []


def test_a_configured_server_is_left_alone(monkeypatch: pytest.MonkeyPatch):
    from compass.infra.temporary_server import start_tied_temporary_server

    monkeypatch.setenv("PREFECT_API_URL", "http://127.0.0.1:4200/api")
    assert start_tied_temporary_server() is None


def test_a_port_taken_before_the_server_binds_it_is_given_up_for_another(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch):
    """Between the free-port check and uvicorn's bind another process can take the port: uvicorn then exits 3, and
    the temporary server starts again on another port instead of failing the run."""
    import shutil
    import socket

    import httpx

    from compass.infra import net
    from compass.infra.temporary_server import _launch
    from tests.conftest import migrated_prefect_database

    shutil.copyfile(migrated_prefect_database(), tmp_path / "prefect.db")
    monkeypatch.setenv("PREFECT_HOME", str(tmp_path))
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    ports = iter([taken.getsockname()[1], net.free_port()])
    monkeypatch.setattr(net, "free_port", lambda: next(ports))
    server = _launch(timeout=180)
    try:
        assert server.api_url != f"http://127.0.0.1:{taken.getsockname()[1]}/api"
        assert httpx.get(f"{server.api_url}/health", timeout=10).status_code == 200
    finally:
        server.stop()
        taken.close()
    assert server.process.returncode is not None
