"""A node lost as its job begins, before srun starts the ranks there (tests/slurm_cluster.py's emulated 2 x 2 GPU
cluster, with Slurm's default SlurmdTimeout of 300 s: srun finds the node gone long before the controller declares it
down, however slowly the step starts on a busy machine)."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import REPO, VENV_BIN, base_env, running_cluster, seeded
from tests.slurm_cluster import lose_node, restart_node
from tests.test_rehearsal_faults import faulty_spec

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def patient_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    with running_cluster(tmp_path_factory.mktemp("patient-cluster"), nodes=2, gpus_per_node=2) as env:
        yield env


def test_a_node_lost_before_srun_starts_the_ranks_requeues_its_job_with_no_orchestrator(
        patient_cluster, data_store: Path, prefect_server: str, tmp_path: Path):
    """The stage's 2-node job (DeepSpeed bf16, a rank per node, `launch: srun`) loses node2 as it turns RUNNING, with
    no orchestrator (killed first): srun cannot launch there ("Task launch ... failed on node node2"), the step notes
    it as retriable (infra/exits.py) and exits 75, and the batch shell requeues the job. Before, the job ended FAILED
    (srun's failure was a plain error) and waited for an orchestrator's retry. The node comes back (its slurmd
    restarted) and the requeued job commits the stage."""
    import signal
    import time

    from compass.infra.layout import WorkFolder
    from compass.infra.slurm import FAILED, read_record, state_of

    conf = patient_cluster["SLURM_CONF"]
    store = tmp_path / "store"
    seeded(store, data_store)
    run = subprocess.Popen([str(VENV_BIN / "compass"), "run", str(faulty_spec(tmp_path, nodes=2, tokens=2560)),
                            "--store", str(store), "--until", "pretrain:stage1"], cwd=REPO,
                           env=base_env(tmp_path / "prefect") | {"PREFECT_API_URL": prefect_server},
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 600

    def state(job: str) -> str:
        assert time.monotonic() < deadline, f"job {job}: {state_of(job)}"
        time.sleep(0.1)
        return state_of(job).state if state_of(job) else ""

    while (work := next(iter(store.glob(".work/pretrain/stage1-*")), None)) is None or read_record(work) is None:
        assert run.poll() is None and time.monotonic() < deadline, "the stage ended before its job was submitted"
        time.sleep(0.1)
    job = read_record(work).job_id
    os.killpg(run.pid, signal.SIGKILL)  # no orchestrator from here on
    run.wait()
    while state(job) != "RUNNING":
        pass
    lose_node(conf, "node2")  # as the job begins: its batch step is still starting, srun has not run
    log = WorkFolder(work).slurm_log
    while not log.exists() or "requeue 1 of 1" not in log.read_text():  # the batch shell requeued its own job
        # (the log appears once the batch step has started: a job RUNNING for the controller may not have it yet)
        assert state(job) not in FAILED, log.read_text()[-6000:] if log.exists() else "no log"
    assert "Task launch for" in log.read_text() and "srun could not start the ranks on node2" in log.read_text()
    slurmd = restart_node(conf, "node2")  # back before the controller declared it down
    try:  # the controller's kill of the job's first run reaches the node before the job can start again
        while not list(store.glob("pretrain/stage1-*/manifest.json")):  # the job commits the step itself
            job_state = state(job)
            assert job_state not in FAILED, log.read_text()[-6000:]
            if job_state == "PENDING" and state_of(job).reason == "BeginTime":  # Slurm's two-minute requeue delay
                subprocess.run(["scontrol", "update", f"JobId={job}", "StartTime=now"], check=True)
    finally:
        slurmd.send_signal(signal.SIGTERM)
        slurmd.wait(30)
    (manifest,) = store.glob("pretrain/stage1-*/manifest.json")
    committed = json.loads(manifest.read_text())
    assert committed["execution"]["slurm_job"] == job  # the same job, requeued by itself
    assert committed["metrics"]["steps"] == 10
