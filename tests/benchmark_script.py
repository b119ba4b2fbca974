"""Running a script of benchmarks/ at a tiny size, as the benchmark tests do."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path
from types import ModuleType

from tests.conftest import REPO

BENCH = REPO / "benchmarks"


def bench_module(name: str) -> ModuleType:
    """A module of benchmarks/ (bench_results, bench_table), imported the way its scripts import each other."""
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    return __import__(name)


def bench(script: str, *args: str, timeout: int = 900, prepared: Path | None = None,
          env: dict[str, str] | None = None, records: bool = True) -> str:
    """`prepared`: one of the session's prepared stores (tests.conftest.data_store, trained_store), which a benchmark
    on the minimal spec copies instead of running its steps again (benchmarks/harness.seeded). The script's result
    file goes to a scratch folder (never benchmarks/results); with `records`, it must hold a comparison."""
    with tempfile.TemporaryDirectory(prefix="compass-bench-results-") as results:
        env = {**os.environ, **(env or {}), "COMPASS_BENCH_RESULTS": results}
        if prepared:
            env["COMPASS_BENCH_PREPARED_STORE"] = str(prepared / "store")
        done = subprocess.run([sys.executable, script, *args], cwd=BENCH, capture_output=True, text=True,
                              timeout=timeout, env=env)
        assert done.returncode == 0, f"{script} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
        written = sorted(Path(results).glob("*.json"))
        if records:
            (path,) = written
            result = bench_module("bench_results").BenchResult.read(path)
            assert result.sections and all(s.rows for s in result.sections), path.read_text()
        else:
            assert not written, [p.name for p in written]
    return done.stdout
