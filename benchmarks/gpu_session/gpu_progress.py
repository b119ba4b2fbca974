"""pytest plugin (`-p gpu_progress`, this folder on sys.path): one line per test as soon as it ends, with its
outcome and seconds (setup + call + teardown), so a session stopped at its time budget (or killed) still tells which
tests passed, failed or were still running; pytest's own -rA summary comes only at the end."""

from __future__ import annotations

import sys
import time
from typing import Any

_started: dict[str, float] = {}
_outcome: dict[str, str] = {}
_why: dict[str, str] = {}


def _say(line: str) -> None:
    sys.stderr.write(f"\n[gpu-progress] {line}\n")
    sys.stderr.flush()


def pytest_runtest_logstart(nodeid: str, location: Any) -> None:
    _started[nodeid] = time.perf_counter()
    _say(f"START  {nodeid}")


def pytest_runtest_logreport(report: Any) -> None:
    if report.failed:
        _outcome[report.nodeid] = "ERROR" if report.when != "call" else "FAILED"
        crash = getattr(report.longrepr, "reprcrash", None)
        message = getattr(crash, "message", None) or str(report.longrepr).strip().splitlines()[-1:]
        _why.setdefault(report.nodeid, " ".join(str(message).split())[:200])
    elif report.skipped and report.nodeid not in _outcome:
        _outcome[report.nodeid] = "SKIPPED"
    elif report.when == "call" and report.passed:
        _outcome[report.nodeid] = "PASSED"


def pytest_runtest_logfinish(nodeid: str, location: Any) -> None:
    seconds = time.perf_counter() - _started.get(nodeid, time.perf_counter())
    why = f": {_why[nodeid]}" if nodeid in _why else ""
    _say(f"{_outcome.get(nodeid, 'PASSED'):7s}{nodeid} ({seconds:.1f} s){why}")
