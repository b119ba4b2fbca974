"""`compass verify` acts only on artifact folders (issue 46, R29): another program's `*/*/manifest.json` under the
folder given (a web app's `public/manifest.json`) is neither checked nor set aside, while a damaged artifact beside
it still is."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from compass.infra.store import Store
from tests.test_store import _commit


def test_R29_set_aside_moves_only_damaged_artifacts(tmp_path: Path):
    from compass.flows.cli import app

    root = tmp_path / "site"
    store = Store(str(root))
    good = _commit(store, "web", {"train/0.tokens": "abc" * 10})
    bad = _commit(store, "code", {"train/0.tokens": "def" * 10})
    (Path(bad.uri) / "train" / "0.tokens").write_text("truncated")
    app_manifest = root / "app" / "public" / "manifest.json"  # a web app's, not an artifact's
    app_manifest.parent.mkdir(parents=True)
    app_manifest.write_text('{"name": "my app", "icons": []}')
    done = CliRunner().invoke(app, ["verify", str(root), "--set-aside", "--json"])
    report = json.loads(done.stdout)
    assert done.exit_code == 1 and report["checked"] == 2 and list(report["damaged"]) == [bad.uri]
    assert app_manifest.read_text() == '{"name": "my app", "icons": []}'  # left where it was
    assert not store.is_committed(bad.uri) and store.is_committed(good.uri)


def _lock_file(store: Store, key: str, body: str, age_s: float) -> Path:
    import os
    import time

    path = Path(store.root_path) / ".locks" / f"{key}.lock"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(body)
    os.utime(path, (time.time() - age_s, time.time() - age_s))
    return path


@pytest.mark.parametrize("body", ["[]", '{"host": "elsewhere", "pid": 7, "heartbeat": "recently"}',
                                  '{"host": "elsewhere", "pid": "five", "heartbeat": 0}', "{not json",
                                  '{"host": "elsewhere", "pid": 7, "heartbeat": 4000000000}'])
def test_R6_R8_a_malformed_or_future_lock_is_taken_over_after_its_file_age(tmp_path: Path, body: str):
    """`[]`, a string heartbeat, `{"pid": "five"}`, broken JSON and a heartbeat in the future (year 2096): broken,
    taken over once the file is older than the stale age; never a traceback, never a 24-hour wait."""
    from compass.infra.locks import step_lock

    store = Store(str(tmp_path / "store"))
    _lock_file(store, "tokenize/notes", body, age_s=120)
    with step_lock(store, "tokenize/notes", timeout_s=10) as lock:
        assert lock is not None


def test_R12_a_paused_run_on_this_machine_keeps_its_lock(tmp_path: Path):
    """A run stopped with SIGSTOP beats no heartbeat, but its process lives with the recorded start time: its lock
    is not taken (a second run computing in its work folder would lose its checkpoints)."""
    import os
    import signal
    import socket
    import subprocess
    import time

    import psutil

    from compass.infra.locks import LockTimeout, step_lock

    paused = subprocess.Popen(["sleep", "300"])
    os.kill(paused.pid, signal.SIGSTOP)
    try:
        store = Store(str(tmp_path / "store"))
        holder = {"host": socket.gethostname(), "pid": paused.pid, "started": psutil.Process(paused.pid).create_time(),
                  "heartbeat": time.time() - 600, "token": "paused"}
        _lock_file(store, "pretrain/stage1", json.dumps(holder), age_s=600)
        with pytest.raises(LockTimeout, match=f"pid {paused.pid}"), step_lock(store, "pretrain/stage1", timeout_s=2):
            pass
    finally:
        paused.kill()
        paused.wait()


def test_R11_a_record_of_another_store_ends_no_run_here(tmp_path: Path):
    """A run record copied with another store's files (its `store` names that one) says nothing about this store's
    runs; this store's own stale record does; a malformed one is skipped without a traceback."""
    import time

    from compass.infra.run_records import RECORDS, dead_runs

    store = Store(str(tmp_path / "b"))
    old = time.time() - 3600
    _lock_file(store, f"{RECORDS}/run-of-a", json.dumps({"host": "elsewhere", "pid": 3, "heartbeat": old,
                                                         "store": str(tmp_path / "a")}), age_s=3600)
    _lock_file(store, f"{RECORDS}/run-of-b", json.dumps({"host": "elsewhere", "pid": 4, "heartbeat": old,
                                                         "store": store.root}), age_s=3600)
    _lock_file(store, f"{RECORDS}/broken", '{"pid": "five", "heartbeat": "x"}', age_s=3600)
    assert [run.flow_run_id for _, run in dead_runs(store)] == ["run-of-b"]
