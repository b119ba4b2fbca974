"""Faults on the emulated GPU cluster (tests/slurm_cluster.py, 2 nodes x 2 GPUs): a controller that stops answering
is asked again, never read as "the job is finished" (N8); a rank that hangs mid-stage makes its job requeue itself,
with no orchestrator, and resume from its newest checkpoint (N6)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from compass.infra.store import Store
from tests.conftest import REPO, VENV_BIN, base_env, seeded, write_minimal_spec

pytestmark = pytest.mark.slow


def test_a_controller_that_does_not_answer_is_asked_again_not_read_as_a_finished_job(gpu_cluster, tmp_path: Path):
    """N8: squeue and scontrol failing (a controller restarting or overloaded: here stopped with SIGSTOP) read as
    "the job is gone", so a follower took a running job or array for finished. Now they are asked again until the
    controller answers."""
    import signal
    import threading
    import time

    from compass.infra.slurm import ask_controller, state_of
    from compass.tasks.data.datatrove_stages import _queued

    job = subprocess.run(["sbatch", "--parsable", "--cpus-per-task=1", f"--output={tmp_path}/out", "--wrap",
                          "sleep 60"], env={**os.environ, **gpu_cluster}, capture_output=True, text=True,
                         check=True).stdout.strip()
    controller = int(Path(gpu_cluster["SLURM_CONF"]).with_name("slurmctld.pid").read_text())
    os.kill(controller, signal.SIGSTOP)
    answers: dict[str, object] = {}
    try:
        threads = [threading.Thread(target=lambda: answers.update(state=state_of(job))),
                   threading.Thread(target=lambda: answers.update(queued=_queued(job)))]
        for thread in threads:
            thread.start()
        time.sleep(25)  # past squeue's and scontrol's own timeouts (MessageTimeout, 10 s)
        assert answers == {}, answers  # still asking, not "gone"
    finally:
        os.kill(controller, signal.SIGCONT)
    for thread in threads:
        thread.join(120)
    assert answers["state"].state in ("RUNNING", "PENDING") and len(answers["queued"]) == 1, answers
    subprocess.run(["scancel", job], env={**os.environ, **gpu_cluster}, check=True)
    assert ask_controller(["scontrol", "show", "job", "-o", "999999"]) is None  # a job it no longer holds


FAULTY_HOW = """how:
  hardware: {accelerator: h100, nodes: 1, devices_per_node: 2}
  parallelism: {deepspeed: true, zero_stage: 0, data_parallel: 2, micro_batch_size: 1}
  precision: bf16
  checkpoints: {every_steps: 5}
  monitoring: {hang_timeout_s: 20}
  orchestration: {retries: 1, cluster: {kind: slurm, poll_seconds: 0.5, shared_root: SHARED}}
"""


def test_a_hung_rank_requeues_its_job_with_no_orchestrator_and_resumes(gpu_cluster, data_store: Path,
                                                                       tmp_path: Path):
    """N6: a rank frozen mid-stage (SIGSTOP): its peer waits in a collective until the hang watchdog (20 s here)
    ends it with the retriable exit; the batch shell requeues the job itself (budget: orchestration.retries), and
    the requeued job resumes from the newest checkpoint and commits. Before, only the time-limit signal requeued:
    the job ended FAILED and waited for a live orchestrator's retry."""
    import signal
    import time

    from compass.infra.slurm import read_record, state_of

    spec = write_minimal_spec(tmp_path, **{"how:\n  parallelism: {micro_batch_size: 2}\n": "",
                                           "tokens: 20000, sequence_length: 64": "tokens: 10240, sequence_length: 64"})
    spec.write_text(spec.read_text() + FAULTY_HOW.replace("SHARED", str(tmp_path / "shared")))
    store = tmp_path / "store"
    seeded(store, data_store)
    run = subprocess.Popen([str(VENV_BIN / "compass"), "run", str(spec), "--store", str(store), "--until",
                            "pretrain:stage1", "--json"], cwd=REPO, env=base_env(tmp_path / "prefect"),
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 600
    while not list(store.glob(".work/pretrain/stage1-*/checkpoints/step-00000010")):
        assert run.poll() is None and time.monotonic() < deadline, run.communicate()[1][-4000:]
        time.sleep(0.5)
    (work,) = store.glob(".work/pretrain/stage1-*")
    ranks = [int(p) for p in subprocess.run(["pgrep", "-f", f"compass.model.training.trainer {work}"],
                                            capture_output=True, text=True).stdout.split()]
    frozen = next(p for p in ranks if b"RANK=1\0" in Path(f"/proc/{p}/environ").read_bytes())
    os.kill(frozen, signal.SIGSTOP)
    job = read_record(work).job_id
    while (state_of(job).state if state_of(job) else "") != "PENDING":  # requeued by its own batch shell
        assert run.poll() is None and time.monotonic() < deadline, run.communicate()[1][-4000:]
        time.sleep(0.5)
    time.sleep(2.5)  # Slurm's two-minute BeginTime for a requeued job, moved to now (tests/test_slurm.py)
    subprocess.run(["scontrol", "update", f"JobId={job}", "StartTime=now"], check=True)
    out, err = run.communicate(timeout=600)
    assert run.returncode == 0, err[-6000:]
    assert "hang watchdog: rank 0" in err and "requeue 1 of 1" in err, err[-6000:]
    step = next(s for s in json.loads(out)["steps"] if s["step"] == "pretrain:stage1")
    manifest = Store(str(store)).read_manifest(step["uri"])
    assert manifest.metrics["resumed_from"] >= 10 and manifest.metrics["steps"] == 40
    assert manifest.execution.slurm_job == job  # the same job, requeued by itself
