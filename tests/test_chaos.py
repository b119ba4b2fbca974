"""The chaos benchmark's sample in the suite (issue 47, item 1): benchmarks/chaos.py at one interruption, a rank
killed mid-stage in the pretraining phase, from the session's prepared data store (the reference trains stage 1
only). The benchmark's own checks decide: the continued run ends, with at most one command, on the uninterrupted
run's exact artifacts, no rank outlives the interruption, `compass verify` passes and the redone work is within its
bound (one checkpoint interval plus the write in flight). (One interruption: each costs a run of the stage. A
killed orchestrator is the suite's tests/test_reliability_kill_loop.py, at several points; `python
benchmarks/chaos.py` draws from every kind and phase.)"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.benchmark_script import bench


@pytest.mark.slow
def test_a_rank_killed_mid_stage_ends_on_the_uninterrupted_weights(data_store: Path):
    out = bench("chaos.py", "--interruptions", "1", "--seed", "1", "--phases", "pretraining", "--kinds",
                "kill -9 rank", prepared=data_store, records=False)
    lines = [line for line in out.splitlines() if re.match(r"\s*\d+ pretraining", line)]
    assert len(lines) == 1 and "kill -9 rank" in lines[0] and ": ok;" in lines[0], out
    assert "0 failed or differ from the uninterrupted run; 0 needed more than one command" in out, out


def test_slurms_interruptions_need_the_cluster_mode_and_say_so():
    """scancel, the time limit and a lost node interrupt Slurm jobs: without --cluster (a 2-node cluster started
    here) the benchmark refuses them before it runs anything, naming the flag."""
    import subprocess
    import sys

    from tests.conftest import REPO

    done = subprocess.run([sys.executable, "benchmarks/chaos.py", "--kinds", "kill -9 rank,scancel"], cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and "unknown phase or kind: scancel" in done.stderr, done.stderr
    assert "need --cluster" in done.stderr


def test_a_journal_lets_a_long_run_go_on_later_and_refuses_another_draw(tmp_path: Path):
    """`--journal`: a 200-interruption run takes hours, more than a session; the interruptions a journal holds are
    not run again and count in the report (a failed one included), and a journal of another draw is refused."""
    import json
    import subprocess
    import sys

    from tests.conftest import REPO

    journal = tmp_path / "chaos.jsonl"
    draw = {"seed": 4, "phases": ["sft"], "kinds": ["kill -9 rank"], "cluster": False}
    held = [{"index": i, "phase": "sft", "kind": "kill -9 rank", "at": 0.5, "outcome": outcome, "commands": 0,
             "differing": [], "redone_s": 0.2, "interval_s": 1.0, "duplicates": 0}
            for i, outcome in enumerate(["ok", "artifacts differ"])]
    journal.write_text("\n".join(json.dumps(line) for line in [{"draw": draw}, *held]) + "\n")
    command = [sys.executable, "benchmarks/chaos.py", "--interruptions", "2", "--seed", "4", "--phases", "sft",
               "--kinds", "kill -9 rank", "--journal", str(journal)]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stderr  # the journal's failed interruption fails the report
    assert "2 interruption(s) already in" in done.stdout and "2 interruptions (0 missed" in done.stdout, done.stdout
    assert "1 failed or differ" in done.stdout and "mean 0.20" in done.stdout, done.stdout
    other = subprocess.run([*command[:5], "5", *command[6:]], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert other.returncode == 1 and "were drawn with" in other.stderr and "--seed" in other.stderr, other.stderr


def test_a_job_is_a_duplicate_only_beside_another_or_after_the_step_committed():
    """--cluster's duplicate count, from the controller's records of a step's jobs: a job resubmitted after one
    failed (a full disk) or was cancelled is the continued run's one resubmission; a requeued job (one id, a
    record per run) is one job; a job submitted while another ran, after one completed, or left queued is a
    duplicate (the seed-301 run counted the full disk's failed job and its resubmission as one too many)."""
    import sys

    from tests.conftest import REPO

    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        from chaos import duplicate_jobs
    finally:
        sys.path.remove(str(REPO / "benchmarks"))

    def job(i: int, submitted: str, ended: str, state: str) -> dict[str, str]:
        return {"JobId": str(i), "SubmitTime": f"2026-11-29T20:{submitted}", "EndTime": f"2026-11-29T20:{ended}",
                "JobState": state}

    failed_then_again = [job(43, "17:17", "17:28", "FAILED"), job(44, "17:53", "18:10", "COMPLETED")]
    assert duplicate_jobs(failed_then_again) == 0
    cancelled_then_again = [job(7, "01:00", "01:30", "CANCELLED"), job(8, "01:30", "02:00", "COMPLETED")]
    assert duplicate_jobs(cancelled_then_again) == 0
    requeued = [job(41, "16:11", "16:29", "PENDING"), job(41, "16:29", "16:31", "COMPLETED")]
    assert duplicate_jobs(requeued) == 0
    assert duplicate_jobs([job(5, "01:00", "02:00", "COMPLETED"), job(6, "01:30", "02:10", "COMPLETED")]) == 1
    assert duplicate_jobs([job(5, "01:00", "02:00", "COMPLETED"), job(6, "03:00", "03:10", "COMPLETED")]) == 1
    assert duplicate_jobs([job(5, "01:00", "02:00", "FAILED")], still_queued=1) == 1
    never_started = {**job(9, "01:00", "01:00", "CANCELLED"), "EndTime": "Unknown"}
    assert duplicate_jobs([never_started, job(10, "01:05", "02:00", "COMPLETED")]) == 0
