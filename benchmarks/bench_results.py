"""What a benchmark run leaves behind: one JSON file per script (`results/<script>.json`), from which
bench_table.py renders the table in docs/development.md. No number in that table is typed by hand.

A script's result holds one section per comparison it reported (harness.report): each variant's median, spread
(min-max over rounds), rounds, ratio to the baseline measured in the same run and peak memory, with the commit,
date and machine it was measured on."""

from __future__ import annotations

import os
import platform
import subprocess
from datetime import UTC, datetime
from pathlib import Path

from pydantic import BaseModel, ConfigDict

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"


def results_dir() -> Path:
    """Where results go: COMPASS_BENCH_RESULTS (the tests' scratch folder), else benchmarks/results."""
    return Path(os.environ.get("COMPASS_BENCH_RESULTS") or RESULTS)


class Row(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    variant: str
    median: float
    low: float  # the spread: min and max over the rounds
    high: float
    rounds: int
    ratio: float  # median / the baseline's median, measured in the same run
    peak_mib: float  # median peak RSS of the variant's process
    memory_ratio: float


class Section(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    title: str
    unit: str
    baseline: str
    higher_is_better: bool
    rows: tuple[Row, ...]
    notes: tuple[str, ...] = ()

    def with_note(self, note: str) -> Section:
        return self.model_copy(update={"notes": (*self.notes, note)})


class Measured(BaseModel):
    """Where and when: the commit (with -dirty for uncommitted changes), the UTC date and the machine."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    commit: str
    date: str
    machine: str

    @classmethod
    def here(cls) -> Measured:
        return cls(commit=_commit(), date=datetime.now(UTC).strftime("%Y-%m-%d"), machine=_machine())


class BenchResult(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    benchmark: str  # the script's name, without .py
    argv: tuple[str, ...]
    measured: Measured
    sections: tuple[Section, ...]

    def write(self, folder: Path | None = None) -> Path:
        folder = folder or results_dir()
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"{self.benchmark}.json"
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(self.model_dump_json(indent=1) + "\n")
        tmp.replace(path)
        return path

    @classmethod
    def read(cls, path: Path) -> BenchResult:
        return cls.model_validate_json(path.read_text())


def _commit(checkout: Path = HERE) -> str:
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=checkout, capture_output=True, text=True).stdout.strip()

    commit = git("rev-parse", "--short=10", "HEAD") or "unknown"
    # the results folder is what `make bench` itself rewrites, script after script: not a change to what it measures
    changed = git("status", "--porcelain", "--untracked-files=no", "--", ":(top,exclude)benchmarks/results")
    return f"{commit}-dirty" if changed else commit


def _machine() -> str:
    """CPU model and cores, memory, and the GPU where torch sees one (without importing torch otherwise)."""
    cpu = platform.processor() or platform.machine()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        names = [line.split(":", 1)[1].strip() for line in cpuinfo.read_text().splitlines()
                 if line.startswith("model name")]
        cpu = names[0] if names else cpu
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    parts = [f"{cpu}, {len(os.sched_getaffinity(0))} cores, {memory:.0f} GiB"]
    import sys

    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        parts.append(f"{torch.cuda.get_device_name(0)} x{torch.cuda.device_count()}")
    return "; ".join(parts)
