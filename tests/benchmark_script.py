"""Running a script of benchmarks/ at a tiny size, as the benchmark tests do."""

from __future__ import annotations

import subprocess
import sys

from tests.conftest import REPO

BENCH = REPO / "benchmarks"


def bench(script: str, *args: str, timeout: int = 900) -> str:
    done = subprocess.run([sys.executable, script, *args], cwd=BENCH, capture_output=True, text=True,
                          timeout=timeout)
    assert done.returncode == 0, f"{script} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done.stdout
