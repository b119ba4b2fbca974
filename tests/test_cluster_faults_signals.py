"""Faults a 384-GPU run meets every few days (issue 74, item 3), on a real three-node Slurm cluster: a rank a signal
ends (NCCL's watchdog aborts with SIGABRT before Python sees an error; a kill) is named by srun with its node, and
is a retriable fault once the step made progress; the job's fault budget counts requeues in any 24 hours of its
life, so faults weeks apart each resume the run while one that repeats at once still stops it; the node a fault was
seen on is left out of the requeued job while the partition has others for it."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from compass.infra.exits import trained_a_step
from compass.infra.layout import WorkFolder
from compass.infra.slurm import JobRequest, run_ranks_step, sbatch_script, state_of, submit
from compass.specs.how import SlurmCluster
from tests.conftest import running_cluster
from tests.test_rehearsal_partitions import history

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def slurm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """Three nodes: a faulty one left out, a second still leaves the job somewhere to run."""
    with running_cluster(tmp_path_factory.mktemp("three-nodes"), nodes=3) as env:
        yield env


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


def fault_job(work: Path, budget: int, command: tuple[str, ...] = ("bash", "-c", "exit 75")) -> JobRequest:
    return JobRequest(workdir=work, command=command, label="faults", nodes=1, tasks_per_node=1,
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


# the step of the job's first two attempts fails as a rank whose GPU reports an ECC error does (infra/exits.py marks
# the fault and its node, the step exits retriable); the third attempt succeeds
FAILING_TWICE = """
import os, sys
from pathlib import Path
from compass.infra.exits import RETRIABLE_EXIT, mark_retriable, this_node
attempt = int(os.environ.get("SLURM_RESTART_COUNT") or 0)
print(f"attempt {attempt} on {this_node()}", flush=True)
if attempt < 2:
    mark_retriable(Path.cwd(), 0, "rank 0: its device failed (uncorrectable ECC error)", (this_node(),))
    sys.exit(RETRIABLE_EXIT)
"""


def test_a_fault_leaves_its_node_out_of_the_requeued_job_while_others_remain(slurm, tmp_path: Path, monkeypatch):
    """Node 3 is the cluster's own `exclude`. The first attempt fails on node A: the requeued job leaves out A (and
    node 3) and runs on the one node left, B, where it fails again: with A and B out the job could not run at all, so
    they stay in (said in the log) and the third attempt runs (Slurm keeps the exclusion it had: on B) and ends."""
    for key, value in slurm.items():
        monkeypatch.setenv(key, value)
    work = tmp_path / "work"
    work.mkdir()
    folder = WorkFolder(work)
    script = work / "job.sbatch"
    cluster = SlurmCluster(shared_root=str(tmp_path), exclude=["node3"])
    script.write_text(sbatch_script(fault_job(work, 2, (sys.executable, "-c", FAILING_TWICE)), cluster))
    job = submit(script)
    deadline = time.monotonic() + 300
    for restart in (1, 2):  # each requeue: its exclusion set by the batch shell, then Slurm's 2-minute delay cut
        while not ((state := state_of(job)) and state.state == "PENDING" and state.restarts == restart
                   and "requeue" in folder.slurm_log.read_text().split("attempt")[-1]):
            assert time.monotonic() < deadline, (state, folder.slurm_log.read_text())
            time.sleep(0.5)
        time.sleep(3)  # the shell sets the pending job's excluded nodes within a second or two of its requeue
        subprocess.run(["scontrol", "update", f"JobId={job}", "StartTime=now"], check=True)
    ended(job)
    log = folder.slurm_log.read_text()
    attempts = [line.split()[-1] for line in log.splitlines() if line.startswith("attempt ")]
    assert len(attempts) == 3 and attempts[0] != attempts[1] and "node3" not in attempts, log
    assert f"leaves out node(s) {attempts[0]},node3 (where faults were seen)" in log, log
    assert "the faulty node(s) stay in: 0 other node(s) in partition" in log, log
    assert folder.fault_nodes.read_text().split() == attempts[:2]
    (done,) = [j for j in history(slurm) if j.get("JobId") == job and j.get("JobState") == "COMPLETED"]
    assert done["NodeList"] == attempts[2] == attempts[1]  # the job's exclusion as the first requeue set it
