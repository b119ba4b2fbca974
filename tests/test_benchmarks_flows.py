"""The flow and data benchmarks at a tiny size (a file of their own, so the suite's two workers share them)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.benchmark_script import bench


@pytest.mark.slow
def test_evaluation_throughput(trained_store: Path):
    out = bench("evaluation_throughput.py", "--samples", "8", "--rounds", "1", prepared=trained_store)
    assert "lighteval directly" in out and "compass evaluate step" in out


@pytest.mark.slow
def test_cached_rerun():
    out = bench("cached_rerun.py", "--rounds", "1", "--until", "ingest")
    assert "cached re-run" in out and "goal: cached re-run <= 0.2x the full run" in out


@pytest.mark.slow
def test_submission_overhead():
    out = bench("submission_overhead.py", "--rounds", "1", "--until", "ingest")
    assert "compass submit --watch" in out and "ratio" in out


@pytest.mark.slow
def test_data_throughput():
    out = bench("data_throughput.py", "--files", "2", "--documents", "50", "--rounds", "1",  # each runner once
                "--variants", "datatrove stages, 2 workers", "compass, 2 workers", "datatrove, 2 workers")
    assert "compass, 2 workers" in out and "datatrove, 2 workers" in out and "ratio" in out
