"""Running a script of benchmarks/ at a tiny size, as the benchmark tests do."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.conftest import REPO

BENCH = REPO / "benchmarks"


def bench(script: str, *args: str, timeout: int = 900, prepared: Path | None = None,
          env: dict[str, str] | None = None) -> str:
    """`prepared`: one of the session's prepared stores (tests.conftest.data_store, trained_store), which a benchmark
    on the minimal spec copies instead of running its steps again (benchmarks/harness.seeded)."""
    env = {**os.environ, **(env or {})}
    if prepared:
        env["COMPASS_BENCH_PREPARED_STORE"] = str(prepared / "store")
    done = subprocess.run([sys.executable, script, *args], cwd=BENCH, capture_output=True, text=True,
                          timeout=timeout, env=env)
    assert done.returncode == 0, f"{script} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done.stdout
