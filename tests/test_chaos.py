"""The chaos benchmark's sample in the suite (issue 47, item 1): benchmarks/chaos.py at one interruption per kind
it draws, on the pretraining phase, from the session's prepared data store (the reference trains stage 1 only).
The benchmark's own checks decide: the continued run ends, with at most one command, on the uninterrupted run's
exact artifacts, `compass verify` passes and the redone work is at most one checkpoint interval."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.benchmark_script import bench


@pytest.mark.slow
def test_a_killed_rank_and_a_killed_orchestrator_mid_stage_end_on_the_uninterrupted_weights(data_store: Path):
    out = bench("chaos.py", "--interruptions", "2", "--seed", "1", "--phases", "pretraining", "--kinds",
                "kill -9 rank,kill -9 orchestrator", prepared=data_store, records=False)
    lines = [line for line in out.splitlines() if re.match(r"\s*\d+ pretraining", line)]
    assert len(lines) == 2 and all(": ok;" in line for line in lines), out
    assert "0 failed or differ from the uninterrupted run; 0 needed more than one command" in out, out
