"""Running a script of benchmarks/ at a tiny size, as the benchmark tests do."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.conftest import REPO

BENCH = REPO / "benchmarks"


def bench(script: str, *args: str, timeout: int = 900, data_store: Path | None = None) -> str:
    """`data_store`: the session's prepared store (tests.conftest.data_store), which a training benchmark copies
    instead of running the minimal spec's data steps again."""
    env = {**os.environ, "COMPASS_BENCH_DATA_STORE": str(data_store / "store")} if data_store else None
    done = subprocess.run([sys.executable, script, *args], cwd=BENCH, capture_output=True, text=True,
                          timeout=timeout, env=env)
    assert done.returncode == 0, f"{script} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done.stdout
