"""A step's Slurm job, on a real cluster (tests/slurm_cluster.py): `scontrol requeue` in the middle resumes from the
newest checkpoint with final weights bitwise those of an undisturbed run; the time-limit signal makes the trainer
checkpoint and the job requeue itself; a failing job names its last log lines; stopping the run cancels the job;
the plan checks the controller and the partition."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from compass.flows.compiler import compile_spec
from compass.flows.runner import RunContext, run_step
from compass.infra import slurm as slurm_jobs
from compass.infra.layout import WorkFolder
from compass.infra.store import Store
from compass.specs import load_spec
from compass.tasks.steps.context import Runtime
from tests.conftest import CHECKPOINTED_STAGE, REPO, cluster_spec, final_weights_sha, seeded

pytestmark = pytest.mark.slow


def wait_for(check, what: str, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def scontrol(*args: str) -> str:
    return subprocess.run(["scontrol", *args], capture_output=True, text=True, check=True).stdout


def release_when_pending(job: str) -> None:
    """A requeued job waits on a BeginTime about two minutes ahead: move it to now."""
    wait_for(lambda: slurm_jobs.state_of(job).state == "PENDING", f"job {job} to be pending again")
    # slurmd refuses a credential issued in the same second as the revocation of the killed run's ("Job
    # credential revoked": the job fails); Slurm's own two-minute BeginTime exists for this
    time.sleep(2.5)
    scontrol("update", f"JobId={job}", "StartTime=now")  # scontrol calls the BeginTime StartTime


def controller_log(env: dict[str, str]) -> str:
    """The controller's last lines, for a failure's message."""
    log = Path(env["SLURM_CONF"]).with_name("slurmctld.log")
    return "\n".join(log.read_text().splitlines()[-30:]) if log.exists() else ""


class StageRun:
    """The first stage of the minimal spec run as its Slurm job by the runner, from a thread of this process (the
    orchestrator), on a copy of the data store."""

    def __init__(self, folder: Path, data_store: Path, **replacements: str):
        self.store = folder / "store"
        seeded(self.store, data_store)
        loaded = load_spec(cluster_spec(folder, folder / "shared", **{**CHECKPOINTED_STAGE, **replacements}))
        plan = compile_spec(loaded.spec).up_to(["pretrain:stage1"])
        how = loaded.spec.how
        store = Store(str(self.store), how.orchestration.cluster.shared_root)
        self.ctx = RunContext(plan, store, loaded.spec_hash, Runtime(how=how, base_dir=loaded.base_dir))
        self.step = plan.step("pretrain:stage1")
        self.work = WorkFolder(store.work_dir("pretrain", "stage1", plan.fingerprints[self.step.id]))
        self.box: dict = {}
        self.lines: list[str] = []  # the step's log: the job's log streams into it
        self.thread = threading.Thread(target=self._run)
        self.thread.start()

    def _run(self) -> None:
        lines = self.lines

        class Keep(logging.Handler):
            def emit(self, record: logging.LogRecord) -> None:
                lines.append(record.getMessage())

        log = logging.getLogger(f"test.slurm.{id(self)}")
        log.setLevel(logging.INFO)
        log.addHandler(Keep())
        try:
            self.box["outcome"] = run_step(self.ctx, self.step, log)
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            self.box["error"] = exc

    def job(self, timeout: float = 300) -> str:
        wait_for(lambda: self.work.job_record.exists() or not self.thread.is_alive(), "the stage's job", timeout)
        assert "error" not in self.box, self.box["error"]
        return slurm_jobs.read_record(self.work.root).job_id

    def wait_for_checkpoint(self, step: int) -> None:
        wait_for(lambda: self.work.checkpoint(step).complete, f"checkpoint {step}")

    def result(self, env: dict[str, str]):
        self.thread.join(600)
        assert "error" not in self.box, f"{self.box.get('error')}\ncontroller: {controller_log(env)}"
        return self.box["outcome"]


def test_a_requeued_job_resumes_bitwise(slurm, data_store: Path, stage1_reference: str, tmp_path: Path):
    run = StageRun(tmp_path, data_store)
    job = run.job()
    run.wait_for_checkpoint(10)
    scontrol("requeue", job)
    release_when_pending(job)
    outcome = run.result(slurm)
    assert 10 <= outcome.manifest.metrics["resumed_from"] < 156
    assert outcome.manifest.execution.slurm_job == job  # the same job, restarted
    assert final_weights_sha(run.store, "pretrain:stage1") == stage1_reference


def test_the_time_limit_signal_checkpoints_and_requeues(slurm, data_store: Path, stage1_reference: str,
                                                        tmp_path: Path):
    """What Slurm does `signal_before_s` before the time limit, sent now: USR1 to the batch shell."""
    run = StageRun(tmp_path, data_store)
    job = run.job()
    run.wait_for_checkpoint(10)
    subprocess.run(["scancel", "--signal=USR1", "--batch", job], check=True)
    release_when_pending(job)
    outcome = run.result(slurm)
    log = "\n".join(run.lines)
    assert "time limit near" in log and "stopped at step" in log and "requeueing job" in log
    stopped_at = int(log.split("stopped at step ")[1].split()[0])
    assert outcome.manifest.metrics["resumed_from"] == stopped_at  # the checkpoint written on the signal
    assert final_weights_sha(run.store, "pretrain:stage1") == stage1_reference


def test_a_failing_job_names_its_last_log_lines(slurm, data_store: Path, tmp_path: Path):
    run = StageRun(tmp_path, data_store, **{"schedule: {kind: wsd, warmup_steps: 2}": (
        "schedule: {kind: wsd, warmup_steps: 2}\n    seed: 3\n    optimizer: {lr: 1.0e+30}\n"
        "    monitors: {divergence: {action: stop}}")})
    run.thread.join(600)
    error = run.box.get("error")
    assert isinstance(error, slurm_jobs.SlurmJobFailed), error
    assert "ended FAILED" in str(error) and "last lines of" in str(error) and "slurm.log" in str(error)
    assert "TrainingStopped" in str(error)  # the trainer's own words, from the job's log


def test_stopping_the_run_cancels_its_slurm_job(slurm, data_store: Path, prefect_server: str, tmp_path: Path):
    spec = cluster_spec(tmp_path, tmp_path / "shared", **CHECKPOINTED_STAGE)
    store = tmp_path / "store"
    seeded(store, data_store)
    run = subprocess.Popen([sys.executable, "-m", "compass.flows.cli.app", "run", str(spec), "--store", str(store),
                            "--until", "pretrain:stage1"], cwd=REPO, stdout=subprocess.DEVNULL,
                           stderr=subprocess.PIPE, text=True,
                           env={**os.environ, "PREFECT_HOME": str(tmp_path / "ph"), "PREFECT_API_URL": prefect_server})
    records: list[Path] = []

    def submitted() -> bool:
        assert run.poll() is None, run.stderr.read()[-3000:]
        records[:] = list(store.rglob(WorkFolder(Path()).job_record.name))
        return bool(records)

    wait_for(submitted, "the pretraining job", timeout=600)
    job = slurm_jobs.read_record(records[0].parent).job_id
    wait_for(lambda: slurm_jobs.state_of(job).state == "RUNNING", "the job to run")
    run.send_signal(signal.SIGTERM)  # what a cancellation from the UI, or Ctrl-C, does to the flow's process
    assert run.wait(120) != 0
    wait_for(lambda: slurm_jobs.state_of(job).state == "CANCELLED", "the job to be cancelled", timeout=60)


def test_plan_checks_the_controller_and_the_partition(slurm):
    from compass.tasks.steps.backends.slurm_checks import slurm_partition

    assert list(slurm_partition("debug", "")) == []
    (issue,) = slurm_partition("hopper-prod", "")
    assert "no partition 'hopper-prod'" in issue.message
