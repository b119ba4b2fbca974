"""kill -9 at several points of a data-only run, then a run to the end: the outputs are those of an uninterrupted
run, the dead run's locks are taken over at once (not after the heartbeat timeout), nothing is left in staging,
and no process the killed runs started is still alive."""

from __future__ import annotations

import hashlib
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

RUN = """
import logging, sys
from pathlib import Path
from compass.flows.compiler import compile_spec
from compass.flows.runner import run_in_process
from compass.infra.store import Store
from compass.specs import load_spec
from compass.tasks.steps.context import Runtime

logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(message)s")
loaded = load_spec(sys.argv[1])
plan = compile_spec(loaded.spec).restricted_to({"ingest", "curate", "tokenizer", "tokenize"})
run_in_process(plan, Store(sys.argv[2]), loaded.spec_hash, Runtime(how=loaded.spec.how, base_dir=loaded.base_dir))
"""


def start(spec: Path, store: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", RUN, str(spec), str(store)], cwd=REPO, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})


def contents(store: Path) -> dict[str, str]:
    """Every committed file by its path in the store (manifests and logs aside: they hold times and hosts)."""
    out = {}
    for path in sorted(store.rglob("*")):
        rel = path.relative_to(store).as_posix()
        timing = "datatrove-logs/" in rel or rel.endswith(".log")  # datatrove's stats and logs hold durations
        if path.is_file() and not rel.startswith(".") and path.name not in ("manifest.json", "summary.md") and \
                not timing:
            out[rel] = hashlib.sha256(path.read_bytes()).hexdigest()  # shards are reproducible: byte for byte
    return out


def living_children(pid: int) -> dict[int, str]:
    """pid -> command line of every descendant still alive (one that ends while they are listed is left out)."""
    out = {}
    for child in psutil.Process(pid).children(recursive=True):
        try:
            out[child.pid] = " ".join(child.cmdline())[:200]
        except (psutil.ZombieProcess, psutil.NoSuchProcess):
            continue
    return out


def test_kill_9_at_several_points_then_finish(data_store: Path, tmp_path: Path):
    spec = write_minimal_spec(tmp_path)
    straight = data_store / "store"  # the same data steps run uninterrupted, once for the session

    store = tmp_path / "killed"
    orphans: dict[int, str] = {}
    for marker in ("ingest/", "curate/", "tokenizer/"):  # kill once the run has committed into each
        proc = start(spec, store)
        deadline = time.monotonic() + 600
        while not any((store / marker.rstrip("/")).glob("*/manifest.json")):
            assert proc.poll() is None and time.monotonic() < deadline, f"the run ended before {marker}"
            time.sleep(0.05)
        orphans |= living_children(proc.pid)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    last = start(spec, store)
    _, log = last.communicate(timeout=600)
    assert last.returncode == 0, log[-3000:]
    assert contents(store) == contents(straight)
    assert "waiting for it" not in log  # the killed runs' locks were not waited out
    assert not [p for p in (store / ".staging").iterdir()]  # nothing half-written left behind
    time.sleep(1)
    assert not [(pid, command) for pid, command in orphans.items() if psutil.pid_exists(pid)
                and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE]
