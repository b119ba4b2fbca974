"""The benchmark table is generated: `make bench` runs every script of benchmarks/, each writes a result file, and
benchmarks/bench_table.py renders docs/development.md's table from those files alone."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.benchmark_script import BENCH, bench_module
from tests.conftest import REPO

# helpers, and reports that compare nothing (identity_mutations.py runs in test_identity, chaos.py's sample in
# test_chaos)
NOT_BENCHMARKS = {"harness.py", "bench_results.py", "bench_table.py", "identity_mutations.py", "chaos.py"}


def result(name: str, sections: list) -> object:
    r = bench_module("bench_results")
    return r.BenchResult(benchmark=name, argv=("--rounds", "3"),
                         measured=r.Measured(commit="abc1234567", date="2026-11-27", machine="Test CPU, 2 cores"),
                         sections=tuple(sections))


def section(title: str, rows: list[tuple[str, float, float, float, float]], baseline: str, notes=()) -> object:
    """rows: (variant, median, low, high, peak MiB)."""
    r = bench_module("bench_results")
    base = next(row for row in rows if row[0] == baseline)
    return r.Section(title=title, unit="tokens/s", baseline=baseline, higher_is_better=True, notes=tuple(notes),
                     rows=tuple(r.Row(variant=v, median=m, low=lo, high=hi, rounds=3, ratio=m / base[1], peak_mib=p,
                                      memory_ratio=p / base[4]) for v, m, lo, hi, p in rows))


def test_make_bench_runs_every_script_in_the_tables_order():
    table = bench_module("bench_table")
    scripts = {p.name for p in BENCH.glob("*.py")} - NOT_BENCHMARKS
    makefile = (REPO / "Makefile").read_text()
    target = makefile.split("\nbench: setup\n", 1)[1].split("\n\n", 1)[0]
    run = re.findall(r"python (\w+\.py)", target)
    assert run[-1] == "bench_table.py"  # the table is rendered after every script ran
    assert run[:-1] == [b.script for b in table.BENCHMARKS]
    assert set(run[:-1]) == scripts  # none left out (engines.py and post_training_throughput.py were)


def test_the_table_shows_each_results_ratio_spread_rounds_and_memory(tmp_path: Path):
    table = bench_module("bench_table")
    result("engines", [section("engines: 2 ranks", [("DDP", 1000.0, 900.0, 1100.0, 500.0),
                                                    ("FSDP2", 1250.0, 1200.0, 1300.0, 400.0)], "DDP",
                               notes=["goal: >= 1.2x"])]).write(tmp_path)
    rendered = table.render(tmp_path)
    (engines,) = [line for line in rendered.splitlines() if line.startswith("| `engines`")]
    assert "*engines: 2 ranks*" in engines
    assert ("FSDP2: **1.25x** DDP (1,250 vs 1,000 tokens/s, higher is better; spread 1,200-1,300 over 3 rounds)"
            in engines)
    assert "peak memory 0.80x (400 MiB)" in engines and "goal: >= 1.2x" in engines
    assert "2026-11-27, `abc1234567`, Test CPU, 2 cores" in engines
    assert "Training engines on the same spec and ranks" in engines  # what it compares: the script's docstring
    (curation,) = [line for line in rendered.splitlines() if line.startswith("| `curation_throughput`")]
    assert "not measured yet" in curation


def test_a_result_no_benchmark_lists_is_refused(tmp_path: Path):
    result("renamed_benchmark", [section("x", [("a", 1.0, 1.0, 1.0, 1.0)], "a")]).write(tmp_path)
    with pytest.raises(SystemExit, match="renamed_benchmark"):
        bench_module("bench_table").render(tmp_path)


def test_the_docs_table_is_the_rendering_of_the_committed_results(tmp_path: Path):
    table = bench_module("bench_table")
    assert table.main(["--check"]) == 0  # docs/development.md holds exactly what benchmarks/results/ renders
    doc = tmp_path / "development.md"
    doc.write_text(table.DOC.read_text().replace("| `engines` |", "| `engines` | 3.1x faster |", 1))
    assert table.main(["--check", "--doc", str(doc)]) == 1  # a number typed into the table is caught


@pytest.mark.slow  # a benchmark run (two rounds of two processes)
def test_a_benchmark_writes_its_result_file_with_where_and_when(tmp_path: Path):
    done = subprocess.run([sys.executable, "loss_memory.py", "--tokens", "256", "--vocab", "2048", "--hidden", "16",
                           "--rounds", "2"], cwd=BENCH, capture_output=True, text=True,
                          env={**os.environ, "COMPASS_BENCH_RESULTS": str(tmp_path)})
    assert done.returncode == 0, done.stderr[-3000:]
    written = bench_module("bench_results").BenchResult.read(tmp_path / "loss_memory.json")
    (s,) = written.sections
    assert s.baseline == "full fp32 logits" and {row.variant for row in s.rows} == {"full fp32 logits", "chunked"}
    chunked = next(row for row in s.rows if row.variant == "chunked")
    assert chunked.rounds == 2 and chunked.low <= chunked.median <= chunked.high and chunked.peak_mib > 0
    assert 0 < chunked.ratio < 1  # chunked needs less than the full logits
    assert any(n.startswith("chunked needs") for n in s.notes) and "chunked needs" in done.stdout
    assert written.measured.commit and written.measured.date and "cores" in written.measured.machine


def test_a_result_names_its_commit_dirty_only_for_changes_outside_the_results_folder(tmp_path: Path):
    """`make bench` rewrites benchmarks/results/ script after script: that is no change to the code it measures,
    while an edited source file is."""
    r = bench_module("bench_results")

    def git(*args: str) -> None:
        subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=tmp_path, check=True,
                       capture_output=True)

    (tmp_path / "benchmarks" / "results").mkdir(parents=True)
    (tmp_path / "benchmarks" / "results" / "x.json").write_text("{}")
    (tmp_path / "model.py").write_text("a = 1\n")
    git("init", "-q")
    git("add", ".")
    git("commit", "-qm", "start")
    head = subprocess.run(["git", "rev-parse", "--short=10", "HEAD"], cwd=tmp_path, capture_output=True,
                          text=True).stdout.strip()
    (tmp_path / "benchmarks" / "results" / "x.json").write_text('{"ratio": 1.0}')
    assert r._commit(tmp_path / "benchmarks") == head
    (tmp_path / "model.py").write_text("a = 2\n")
    assert r._commit(tmp_path / "benchmarks") == f"{head}-dirty"
