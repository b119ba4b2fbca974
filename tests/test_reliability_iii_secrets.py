"""Secrets stay out of every message, and a tracker that does not answer costs seconds (issue 46, R18, R19, R24,
R25): a PostgreSQL URL whose password holds an unencoded `/`, `#` or `@`, or a `?password=`, is refused or reported
without the password and without a traceback; an MLflow URI's `user:password@` is redacted in the tracker's warning,
and its client gives up after one retry instead of MLflow's seven."""

from __future__ import annotations

import socket
import threading
from pathlib import Path

import pytest
from typer.testing import CliRunner

from compass.infra.net import free_port
from compass.infra.redact import redact

SECRET = "pa/ss#wo@rd"


def test_redact_hides_passwords_however_they_are_written():
    assert redact(f"postgresql://prefect:{SECRET}@db:5432/prefect") == "postgresql://prefect:***@db:5432/prefect"
    assert redact("postgresql://u@db/x?password=hunter2&sslmode=require") == \
        "postgresql://u@db/x?password=***&sslmode=require"
    assert redact("failed: http://alice:s3cr3t@mlflow:5000/api then") == "failed: http://alice:***@mlflow:5000/api then"
    assert redact("sqlite:////tmp/mlflow.db") == "sqlite:////tmp/mlflow.db"


@pytest.mark.parametrize("url", [f"postgresql://prefect:{SECRET}@127.0.0.1:{{port}}/prefect",
                                 "postgresql://prefect@127.0.0.1:{port}/prefect?password=hunter2",
                                 "postgresql://prefect:hunter2@127.0.0.1:{port}"])
def test_R18_R19_a_database_url_never_prints_its_password(url: str):
    from compass.flows.cli.app import app

    done = CliRunner().invoke(app, ["server", "--database", url.format(port=free_port())])
    assert done.exit_code in (1, 2), done.output
    assert "Traceback" not in done.output
    for secret in ("pa/ss", "wo@rd", "hunter2"):
        assert secret not in done.output, done.output
    assert "***" in done.output or "names no host or no database" in done.output


class ClosingServer:
    """A port that accepts connections and closes them at once, counting them: what a broken server does."""

    def __init__(self):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.port = self.sock.getsockname()[1]
        self.accepted = 0
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.accepted += 1
            conn.close()


def test_R24_R25_an_mlflow_server_that_does_not_answer_is_given_up_fast_and_its_password_is_not_logged(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch):
    from compass.model.training.trackers import FAIL_FAST, Trackers
    from tests.test_trackers import a_run

    for name in FAIL_FAST:
        monkeypatch.delenv(name, raising=False)
    server = ClosingServer()
    try:
        trackers = Trackers(a_run(tmp_path, f"http://alice:s3cr3t@127.0.0.1:{server.port}", trackers=("mlflow",)))
    finally:
        server.sock.close()
    assert trackers.sinks == {}  # training goes on without it
    assert "mlflow run not opened" in caplog.text
    assert "s3cr3t" not in caplog.text and "alice:***@127.0.0.1" in caplog.text
    assert 1 <= server.accepted <= 2  # one request, retried once (MLflow's default: 7 retries with backoff)
