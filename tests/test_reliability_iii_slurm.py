"""Slurm job records are trusted only when they match (issue 46, R1 and R3), on the suite's one-node Slurm cluster:
a step's `slurm-job.json` or a data stage's array record naming another job (another name, here a running job
called `victim`) is logged as not the step's and is neither followed nor cancelled; an id that is not a Slurm job id
(`--user=alice`) is never read as one."""

from __future__ import annotations

import logging
import subprocess
import sys
import time
from pathlib import Path

import pytest

from compass.infra import slurm as slurm_jobs
from compass.infra.layout import WorkFolder
from compass.specs.how import SlurmCluster

pytestmark = pytest.mark.slow


@pytest.fixture
def victim(slurm, tmp_path: Path):
    """Someone else's running job: another name, another folder."""
    folder = tmp_path / "victim"
    folder.mkdir()
    job = subprocess.run(["sbatch", "--parsable", "--job-name=victim", f"--chdir={folder}",
                          f"--output={folder}/out.log", "--wrap", "sleep 600"], capture_output=True, text=True,
                         check=True).stdout.strip().split(";")[0]
    deadline = time.monotonic() + 60
    while slurm_jobs.state_of(job).state != "RUNNING":
        assert time.monotonic() < deadline, "the victim job never started"
        time.sleep(0.2)
    yield job
    subprocess.run(["scancel", job], capture_output=True)


def own_job(workdir: Path) -> slurm_jobs.JobRequest:
    return slurm_jobs.JobRequest(workdir=workdir, command=(sys.executable, "-c", "print('the step ran')"),
                                 label="ingest-notes", nodes=1, tasks_per_node=1, cpus_per_task=1, gpus_per_node=None,
                                 memory_gb=None, time_limit=None, exclusive=False)


def plant(workdir: Path, job_id: str) -> None:
    workdir.mkdir(parents=True, exist_ok=True)
    WorkFolder(workdir).job_record.write_text(
        f'{{"job_id": "{job_id}", "script": "{workdir}/job.sbatch", "submitted_at": {time.time()}, '
        '"host": "elsewhere", "pid": 1}')


def test_R1_a_record_naming_another_job_is_neither_followed_nor_cancelled(victim: str, tmp_path: Path,
                                                                          caplog: pytest.LogCaptureFixture):
    workdir = tmp_path / "step"
    plant(workdir, victim)
    cluster = SlurmCluster(shared_root=str(tmp_path), poll_seconds=0.5)
    with caplog.at_level(logging.INFO):
        job_id = slurm_jobs.run_on_slurm(own_job(workdir), cluster, logging.getLogger("test.r1"), done=lambda: False)
    assert job_id != victim
    assert f"names Slurm job {victim}, which is not this step's job (its name is victim, not compass-ingest-notes)" \
        in caplog.text
    assert "the step ran" in WorkFolder(workdir).slurm_log.read_text()
    assert slurm_jobs.state_of(victim).state == "RUNNING"  # followed by nobody, cancelled by nobody
    assert slurm_jobs.read_record(workdir).job_id == job_id  # the record now names the step's own job


def test_R1_a_data_stages_array_record_naming_another_job_is_not_followed(victim: str, tmp_path: Path,
                                                                          caplog: pytest.LogCaptureFixture):
    from compass.tasks.steps.backends.slurm_arrays import ARRAY_RECORD, _recorded_live_jobs

    record = tmp_path / ARRAY_RECORD
    record.write_text(f'{{"job_ids": ["{victim}"], "submitted_at": {time.time()}}}')
    with caplog.at_level(logging.WARNING):
        assert _recorded_live_jobs(record, "compass-notes-curate", logging.getLogger("test.r1")) == ""
    assert f"names Slurm jobs {victim}, which are not this stage's (victim" in caplog.text
    assert slurm_jobs.state_of(victim).state == "RUNNING"


def test_R3_an_option_like_id_is_never_read_as_a_job_id(slurm, tmp_path: Path, caplog: pytest.LogCaptureFixture):
    workdir = tmp_path / "step"
    plant(workdir, "--user=alice")
    assert slurm_jobs.read_record(workdir) is None
    cluster = SlurmCluster(shared_root=str(tmp_path), poll_seconds=0.5)
    with caplog.at_level(logging.INFO):
        job_id = slurm_jobs.run_on_slurm(own_job(workdir), cluster, logging.getLogger("test.r3"), done=lambda: False)
    assert job_id.isdigit()
    assert "is not a job record compass wrote (unreadable, or its job id is not a Slurm job id): ignored" in \
        caplog.text
    array = tmp_path / "array_job.json"
    array.write_text('{"job_ids": ["--user=alice"]}')
    from compass.tasks.steps.backends.slurm_arrays import _recorded_live_jobs

    assert _recorded_live_jobs(array, "compass-x", logging.getLogger("test.r3")) == ""
    assert "names ['--user=alice'], not Slurm job ids: ignored" in caplog.text
