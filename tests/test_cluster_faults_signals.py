"""Faults a 384-GPU run meets every few days (issue 74, item 3), on a real one-node Slurm cluster: a rank a signal
ends (NCCL's watchdog aborts with SIGABRT before Python sees an error; a kill) is named by srun with its node, and
is a retriable fault once the step made progress; the job's fault budget counts requeues in any 24 hours of its
life, so faults weeks apart each resume the run while one that repeats at once still stops it."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from compass.infra.exits import trained_a_step
from compass.infra.layout import WorkFolder
from compass.infra.slurm import JobRequest, run_ranks_step, sbatch_script, state_of, submit
from compass.specs.how import SlurmCluster
from tests.test_rehearsal_partitions import history

pytestmark = pytest.mark.slow


def test_a_rank_ended_by_a_signal_is_named_by_srun_with_its_node(slurm, tmp_path: Path, monkeypatch):
    for key, value in slurm.items():
        monkeypatch.setenv(key, value)
    # rank 1 aborts as NCCL's watchdog does (SIGABRT); srun terminates rank 0, which was waiting in a collective
    ended = run_ranks_step(["srun", "--kill-on-bad-exit=1", "--nodes=1", "--ntasks=2", "--cpus-per-task=1", "bash",
                            "-c", 'if [ "$SLURM_PROCID" = 1 ]; then sleep 1; kill -ABRT $$; fi; sleep 60'], tmp_path)
    assert ended.code != 0
    assert len(ended.signalled) >= 1 and ended.signalled[0].endswith("task 1: Aborted"), ended
    clean = run_ranks_step(["srun", "--nodes=1", "--ntasks=1", "--cpus-per-task=1", "bash", "-c", "exit 3"], tmp_path)
    assert clean.code == 3 and clean.signalled == ()  # a rank's own exit is no signal


def test_a_signal_is_a_retriable_fault_only_once_the_step_made_progress(tmp_path: Path):
    work = WorkFolder(tmp_path)
    assert not trained_a_step(tmp_path)  # before any step: the code's or the spec's fault, requeueing repeats it
    work.metrics.write_text(json.dumps({"step": 1, "loss": 3.0}) + "\n")
    assert trained_a_step(tmp_path)
    trl = tmp_path / "trl"
    (WorkFolder(trl).trl_checkpoints / "checkpoint-4").mkdir(parents=True)
    assert not trained_a_step(trl)
    (WorkFolder(trl).trl_checkpoints / "checkpoint-4" / "trainer_state.json").write_text("{}")
    assert trained_a_step(trl)


def fault_job(work: Path, budget: int) -> JobRequest:
    return JobRequest(workdir=work, command=("bash", "-c", "exit 75"), label="faults", nodes=1, tasks_per_node=1,
                      cpus_per_task=1, gpus_per_node=None, memory_gb=None, time_limit="5", exclusive=False,
                      fault_requeues=budget)


def ended(job: str, timeout_s: float = 240) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        state = state_of(job)
        if state is None or not state.live:
            return
        time.sleep(1)
    raise AssertionError(f"job {job} still {state_of(job)} after {timeout_s} s")


def test_the_fault_budget_counts_requeues_in_any_24_hours_not_over_the_jobs_life(slurm, tmp_path: Path,
                                                                                 monkeypatch):
    """Budget 1: a fault two days after the last one requeues the job (a life-long count of 1 would have ended it);
    the same fault again at once ends it, said in its log."""
    for key, value in slurm.items():
        monkeypatch.setenv(key, value)
    work = tmp_path / "work"
    work.mkdir()
    folder = WorkFolder(work)
    folder.failure_requeues.write_text(f"{int(time.time()) - 2 * 86400}\n")  # a fault two days ago
    script = work / "job.sbatch"
    script.write_text(sbatch_script(fault_job(work, budget=1), SlurmCluster(shared_root=str(tmp_path))))
    job = submit(script)
    ended(job)
    log = " ".join(folder.slurm_log.read_text().split())
    assert "requeue 1 of 1 in 24 hours" in log, log
    assert "1 retriable faults in 24 hours already" in log, log
    runs = [j for j in history(slurm) if j.get("JobId") == job]
    assert len(runs) == 2, runs  # the first attempt, requeued; the second, which ended the job
    times = [int(t) for t in folder.failure_requeues.read_text().split()]
    assert len(times) == 3 and times[1] > time.time() - 600  # the old fault and the two of today
