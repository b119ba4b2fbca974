"""Training stages as jobs of a real Slurm cluster (tests/slurm_cluster.py starts one on this machine): the job
runs and commits only when COMPLETED; `scontrol requeue` in the middle resumes from the newest checkpoint with
final weights bitwise those of an uninterrupted run; the time-limit signal makes the trainer checkpoint and the
job requeue itself; a failing job names its last log lines; stopping the run cancels the job."""

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

from compass.infra import slurm
from compass.specs.how import SlurmCluster
from tests.conftest import REPO, write_minimal_spec
from tests.slurm_cluster import missing, slurm_cluster
from tests.test_tensor_parallel import final_weights

pytestmark = pytest.mark.slow
CLUSTER = SlurmCluster(poll_seconds=0.5)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory):
    why = missing()
    if why:
        pytest.skip(why)
    with slurm_cluster(tmp_path_factory.mktemp("slurm")) as env:
        saved = os.environ.get("SLURM_CONF")
        os.environ.update(env)
        try:
            yield env
        finally:
            if saved is None:
                os.environ.pop("SLURM_CONF", None)
            else:
                os.environ["SLURM_CONF"] = saved


def scontrol(*args: str) -> str:
    return subprocess.run(["scontrol", *args], capture_output=True, text=True, check=True).stdout


def job_id(workdir: Path, timeout: float = 120) -> str:
    import json

    deadline = time.monotonic() + timeout
    while not (workdir / slurm.JOB_FILE).exists():
        assert time.monotonic() < deadline, "no job was submitted"
        time.sleep(0.1)
    return json.loads((workdir / slurm.JOB_FILE).read_text())["job_id"]


def wait_for(check, what: str, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def release_when_pending(job: str) -> None:
    """A requeued job waits on a BeginTime about two minutes ahead: move it to now."""
    wait_for(lambda: slurm.state_of(job).state == "PENDING", f"job {job} to be pending again")
    # slurmd refuses a credential issued in the same second as the revocation of the killed run's ("Job
    # credential revoked": the job fails); Slurm's own two-minute BeginTime exists for this
    time.sleep(2.5)
    scontrol("update", f"JobId={job}", "StartTime=now")  # scontrol calls the BeginTime StartTime


def controller_log(env: dict[str, str]) -> str:
    """The controller's last lines, for a failure's message."""
    log = Path(env["SLURM_CONF"]).with_name("slurmctld.log")
    return "\n".join(log.read_text().splitlines()[-30:]) if log.exists() else ""


def in_thread(fn) -> tuple[threading.Thread, dict]:
    box: dict = {}

    def target() -> None:
        try:
            box["result"] = fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            box["error"] = exc

    thread = threading.Thread(target=target)
    thread.start()
    return thread, box


def test_the_batch_script_says_what_the_spec_says(tmp_path: Path, stage1_job):
    from compass.tasks.common.training import slurm_shape

    job = stage1_job(tmp_path / "w")
    spec = SlurmCluster(partition="gpu", account="lm", qos="high", constraint="h100", exclude=["node[07-08]"],
                        cpus_per_task=16, time_limit="2-00:00:00", signal_before_s=300)
    two_nodes = job.model_copy(update={"hardware": job.hardware.model_copy(update={
        "nodes": 2, "devices_per_node": 8, "accelerator": "h100"}), "parallelism": job.parallelism.model_copy(
        update={"data_parallel": 16})})
    script = slurm.sbatch_script(slurm_shape(two_nodes, tmp_path / "job.json"), spec, "/venv/python",
                                 "pretrain-stage1", 29500)
    for line in ("#SBATCH --nodes=2", "#SBATCH --gpus-per-node=8", "#SBATCH --partition=gpu", "#SBATCH --account=lm",
                 "#SBATCH --qos=high", "#SBATCH --constraint=h100", "#SBATCH --exclude=node[07-08]",
                 "#SBATCH --cpus-per-task=16", "#SBATCH --time=2-00:00:00", "#SBATCH --requeue",
                 "#SBATCH --signal=B:USR1@300", "trap on_time_limit USR1"):
        assert line in script.splitlines(), line
    assert '--node-rank "$SLURM_NODEID"' in script and "--nproc-per-node 8" in script
    single = slurm.sbatch_script(slurm_shape(job, tmp_path / "job.json"), SlurmCluster(requeue=False), "/venv/python",
                                 "x", 1)
    assert "#SBATCH --no-requeue" in single and "torch.distributed.run" not in single


def test_a_stage_runs_as_a_slurm_job_and_a_requeue_resumes_it_bitwise(cluster, stage1_job, tmp_path: Path):
    from compass.tasks.common.training import run_training

    log = logging.getLogger("test")
    straight = run_training(stage1_job(tmp_path / "straight"), log, CLUSTER)
    assert straight.resumed_from is None and straight.steps == 78
    assert "restart 0" in (tmp_path / "straight" / "slurm.log").read_text()

    requeued = tmp_path / "requeued"
    thread, box = in_thread(lambda: run_training(stage1_job(requeued), log, CLUSTER))
    job = job_id(requeued)
    wait_for(lambda: (requeued / "checkpoints" / "step-00000010" / "checksums.json").exists(), "checkpoint 10")
    scontrol("requeue", job)
    release_when_pending(job)
    thread.join(600)
    assert "error" not in box, f"{box.get('error')}\ncontroller: {controller_log(cluster)}"
    result = box["result"]
    assert 10 <= result.resumed_from < 78
    assert "restart 1" in (requeued / "slurm.log").read_text()
    a, b = final_weights(tmp_path / "straight"), final_weights(requeued)
    assert a.keys() == b.keys() and all(bool((a[k] == b[k]).all()) for k in a)


def test_the_time_limit_signal_checkpoints_and_requeues(cluster, stage1_job, tmp_path: Path):
    """What Slurm does `signal_before_s` before the time limit, sent now: USR1 to the batch shell."""
    from compass.tasks.common.training import run_training

    work = tmp_path / "limited"
    thread, box = in_thread(lambda: run_training(stage1_job(work), logging.getLogger("test"), CLUSTER))
    job = job_id(work)
    wait_for(lambda: (work / "checkpoints" / "step-00000010" / "checksums.json").exists(), "checkpoint 10")
    subprocess.run(["scancel", "--signal=USR1", "--batch", job], check=True)
    release_when_pending(job)
    thread.join(600)
    assert "error" not in box, box.get("error")
    text = (work / "slurm.log").read_text()
    assert "time limit near" in text and "stopped at step" in text and "requeueing job" in text
    stopped_at = int(text.split("stopped at step ")[1].split()[0])
    assert box["result"].resumed_from == stopped_at  # the checkpoint written on the signal


def test_a_failing_job_names_its_last_log_lines(cluster, stage1_job, tmp_path: Path):
    from compass.tasks.common.training import run_training

    job = stage1_job(tmp_path / "broken")
    broken = job.model_copy(update={"sources": {name: tmp_path / "nowhere" for name in job.sources}})
    with pytest.raises(slurm.SlurmJobFailed, match=r"(?s)ended FAILED.*last lines of .*slurm.log.*nowhere"):
        run_training(broken, logging.getLogger("test"), CLUSTER)


def test_stopping_the_run_cancels_its_slurm_job(cluster, tmp_path: Path):
    spec = write_minimal_spec(tmp_path, **{"  parallelism: {micro_batch_size: 2}": (
        "  parallelism: {micro_batch_size: 2}\n  orchestration: {cluster: {kind: slurm, poll_seconds: 0.5}}")})
    store = tmp_path / "store"
    run = subprocess.Popen([sys.executable, "-m", "compass.flows.cli", "run", str(spec), "--store", str(store),
                            "--until", "pretrain:stage1"], cwd=REPO, stdout=subprocess.DEVNULL,
                           stderr=subprocess.PIPE, text=True, env={**os.environ, "PREFECT_HOME": str(tmp_path / "ph")})
    records: list[Path] = []

    def submitted() -> bool:
        assert run.poll() is None, run.stderr.read()[-3000:]
        records[:] = list((store / ".work").glob(f"pretrain/*/{slurm.JOB_FILE}"))
        return bool(records)

    wait_for(submitted, "the pretraining job", timeout=600)
    job = job_id(records[0].parent)
    wait_for(lambda: slurm.state_of(job).state == "RUNNING", "the job to run")
    run.send_signal(signal.SIGTERM)  # what a cancellation from the UI, or Ctrl-C, does to the flow's process
    assert run.wait(120) != 0
    wait_for(lambda: slurm.state_of(job).state == "CANCELLED", "the job to be cancelled", timeout=60)


def test_plan_checks_the_controller_and_the_partition(cluster):
    from compass.flows.validation import _slurm_partition

    assert list(_slurm_partition("debug", "")) == []
    (issue,) = _slurm_partition("hopper-prod", "")
    assert "no partition 'hopper-prod'" in issue.message


SFT = """  post_training:
    - {method: sft, name: sft, dataset: "pypi://evals==3.0.1.post1", lr: 1.0e-3, max_samples: 16, max_length: 128,
       batch_size: 8}
  evaluation:
    perplexity_sources: [notes]
  pretraining:"""


def test_post_training_and_evaluation_run_as_one_node_jobs(cluster, tmp_path: Path):
    """TRL and lighteval do not use compass's trainer: the whole step runs in a job (tasks/step_job.py), and
    what it wrote is committed as the step's artifact."""
    from compass.flows.compiler import compile_spec
    from compass.flows.runner import run_in_process
    from compass.infra.store import Store
    from compass.specs import load_spec
    from compass.tasks.steps.context import Runtime

    spec = write_minimal_spec(tmp_path, **{"  pretraining:": SFT, "  parallelism: {micro_batch_size: 2}": (
        "  parallelism: {micro_batch_size: 2}\n  orchestration: {cluster: {kind: slurm, poll_seconds: 0.5}}")})
    loaded = load_spec(spec)
    plan = compile_spec(loaded.spec).up_to(["post_train:sft", "evaluate:post_train-sft"])
    lines: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(record.getMessage())

    log = logging.getLogger("test.slurm.steps")
    log.addHandler(Keep())
    log.setLevel(logging.INFO)
    outcomes = run_in_process(plan, Store(str(tmp_path / "store")), loaded.spec_hash,
                              Runtime(how=loaded.spec.how, base_dir=loaded.base_dir), log)
    sft, evaluated = outcomes["post_train:sft"], outcomes["evaluate:post_train-sft"]
    assert sft.executed and sft.manifest.metrics["method"] == "sft" and sft.manifest.metrics["steps"] > 0
    assert (Path(sft.uri) / "final" / "model.safetensors").exists()
    assert evaluated.manifest.metrics["val_ppl:notes"] > 1
    submitted = [line for line in lines if line.startswith("submitted Slurm job")]
    assert any("post_train/sft-" in line for line in submitted), submitted
    assert any("evaluate/post_train-sft-" in line for line in submitted), submitted
    assert any("pretrain/stage1-" in line for line in submitted), submitted  # the trainer's own job
