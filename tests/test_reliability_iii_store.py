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
    from compass.flows.cli.app import app

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


def test_R29_verify_acts_only_on_a_compass_store(tmp_path: Path):
    """A folder compass never wrote a store into is refused whole, even where its layout looks like artifacts: a copy
    of a store's artifact folder without the store's marker is not set aside."""
    import shutil

    from compass.flows.cli.app import app
    from compass.infra.store import STORE_MARKER

    store = Store(str(tmp_path / "store"))
    assert not store.is_marked()  # an empty root is not one yet
    bad = _commit(store, "code", {"train/0.tokens": "def" * 10})
    assert store.is_marked() and (tmp_path / "store" / STORE_MARKER).is_file()
    (Path(bad.uri) / "train" / "0.tokens").write_text("truncated")
    elsewhere = tmp_path / "website"
    shutil.copytree(tmp_path / "store", elsewhere, ignore=shutil.ignore_patterns(STORE_MARKER))
    done = CliRunner().invoke(app, ["verify", str(elsewhere), "--set-aside"])
    assert done.exit_code == 2 and "not a compass store" in done.stderr and STORE_MARKER in done.stderr
    assert list(elsewhere.glob("tokenize/code-*/manifest.json"))  # nothing moved
    assert CliRunner().invoke(app, ["verify", str(tmp_path / "store")]).exit_code == 1  # the store itself: checked


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


@pytest.mark.parametrize("errno_name", ["EFBIG", "EDQUOT"])
def test_R15_a_file_size_limit_or_quota_is_one_message_with_the_path_and_not_retried(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, errno_name: str):
    """`ulimit -f` (EFBIG: the write itself, in a child limited to 64 KiB, raises what a step's write raises) and an
    exhausted quota (EDQUOT) are reported like a full disk: the step, the path, what is free, no retry."""
    import errno
    import logging
    import subprocess
    import sys

    from prefect.states import Failed

    from compass.flows import runner
    from compass.flows.lifecycle import worth_retrying
    from compass.infra.errors import DiskFull
    from compass.tasks.steps.context import StepResult
    from tests.test_store import one_step

    big = tmp_path / "big.bin"
    limited = ("import resource, signal; signal.signal(signal.SIGXFSZ, signal.SIG_IGN); "
               "resource.setrlimit(resource.RLIMIT_FSIZE, (65536, 65536)); "
               f"open({str(big)!r}, 'wb').write(b'x' * 200000)")
    done = subprocess.run([sys.executable, "-c", limited], capture_output=True, text=True)
    assert "OSError: [Errno 27] File too large" in done.stderr  # what the write raises under `ulimit -f`
    code = getattr(errno, errno_name)

    def hits_the_limit(ctx) -> StepResult:
        raise OSError(code, "limit", str(ctx.out / "train" / "00001.tokens"))

    ctx, step = one_step(tmp_path, monkeypatch, hits_the_limit)
    with pytest.raises(DiskFull, match=r"slow:web: .* at .*00001.tokens \([\d,]+ MiB free there\): free space "
                                       r"\(or raise the limit"):
        runner.run_step(ctx, step, logging.getLogger("test"))
    assert not worth_retrying(None, None, Failed(data=DiskFull(code, "limit")))


@pytest.mark.slow
def test_R36_a_file_name_that_is_not_utf8_is_skipped_and_named(tmp_path: Path):
    """It crashed ingest in datatrove's writer (`str is not valid UTF-8: surrogates not allowed`), retried, every
    run, until renamed: now it is left out like a binary file, named in the step's metrics."""
    import os

    from compass.flows.compiler import compile_spec
    from compass.flows.runner import run_in_process
    from compass.specs import load_spec
    from compass.tasks.steps.context import Runtime
    from tests.conftest import write_minimal_spec

    source = tmp_path / "notes"
    source.mkdir()
    with open(os.path.join(os.fsencode(source), b"bad\xff\xfe.txt"), "wb") as f:
        f.write(b"A document whose file name is not UTF-8 at all. " * 20)
    (source / "good.txt").write_text("A good document with plenty of words for every filter to keep. " * 20)
    spec = write_minimal_spec(tmp_path)
    spec.write_text(spec.read_text().replace(spec.read_text().split("uri: ")[1].split("\n")[0], str(source), 1))
    loaded = load_spec(spec)
    outcomes = run_in_process(compile_spec(loaded.spec).up_to(["ingest:notes"]), Store(str(tmp_path / "store")),
                              loaded.spec_hash, Runtime(how=loaded.spec.how, base_dir=loaded.base_dir))
    metrics = outcomes["ingest:notes"].manifest.metrics
    assert metrics["skipped"] == {"bad\ufffd\ufffd.txt": "a file name that is not UTF-8: rename it to include it"}
    assert metrics["documents"] >= 1


def test_R16_verify_summarises_each_damaged_artifact(tmp_path: Path):
    """A damaged artifact with thousands of missing files is one header and ten lines, not a line per file."""
    from compass.flows.cli.app import app

    store = Store(str(tmp_path / "store"))
    files = {f"train/{i:05d}.tokens": "t" for i in range(2000)}
    damaged = _commit(store, "code", files)
    for i in range(0, 2000):
        (Path(damaged.uri) / f"train/{i:05d}.tokens").unlink()
    done = CliRunner().invoke(app, ["verify", str(tmp_path / "store")])
    assert done.exit_code == 1
    lines = done.stdout.splitlines()
    assert len(lines) <= 14, lines[:20]
    assert "2,000 problems" in lines[0] and "... and 1,990 more (--json lists them all)" in done.stdout
