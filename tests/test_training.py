"""Training for real on the fixture corpus: kill -9 mid-stage and resume bitwise, with DeepSpeed and with
plain torch (several ranks: tests/test_launcher.py)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from safetensors.torch import load_file

from compass.infra.net import free_port
from compass.model.training.job import TrainJob
from tests.conftest import REPO

pytestmark = pytest.mark.slow


def trainer(job: TrainJob, workdir: Path) -> subprocess.Popen:
    workdir.mkdir(parents=True, exist_ok=True)
    job.write(workdir / "job.json")
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "RANK": "0",
           "WORLD_SIZE": "1", "LOCAL_RANK": "0"}
    return subprocess.Popen([sys.executable, "-m", "compass.model.training.trainer", str(workdir / "job.json")],
                            cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def final_weights(workdir: Path) -> dict:
    last = sorted((workdir / "checkpoints").glob("step-*"))[-1]
    return load_file(str(last / "hf" / "model.safetensors"))


def final_generators(workdir: Path) -> dict:
    """The random generators' states the last checkpoint holds (what a run resumed from it restores)."""
    import torch

    last = sorted((workdir / "checkpoints").glob("step-*"))[-1]
    held = last / "deepspeed" / "mp_rank_00_model_states.pt"
    state = torch.load(held if held.exists() else last / "state.pt", map_location="cpu", weights_only=False)
    return state["extra"]["rng"]  # DeepSpeed keeps compass's client state at the top of its model states


@pytest.mark.parametrize("use_deepspeed", [True, False], ids=["deepspeed", "torch"])
def test_kill_9_mid_stage_then_resume_is_bitwise_identical(stage1_job, tmp_path: Path, use_deepspeed: bool):
    straight = tmp_path / "straight"
    job = stage1_job(straight, deepspeed=use_deepspeed)
    assert trainer(job, straight).wait(timeout=600) == 0

    killed = tmp_path / "killed"
    job = stage1_job(killed, deepspeed=use_deepspeed)
    proc = trainer(job, killed)
    deadline = time.monotonic() + 600
    while not (killed / "checkpoints" / "step-00000030" / "checksums.json").exists():
        assert proc.poll() is None and time.monotonic() < deadline, "trainer ended before the kill"
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    result_path = killed / "result.json"
    assert not result_path.exists()
    assert trainer(job, killed).wait(timeout=600) == 0
    result = json.loads(result_path.read_text())
    assert result["resumed_from"] is not None and result["resumed_from"] >= 30
    a, b = final_weights(straight), final_weights(killed)
    assert a.keys() == b.keys()
    assert all(a[k].equal(b[k]) for k in a)  # bitwise
    straight_rng, killed_rng = final_generators(straight), final_generators(killed)  # Python's and NumPy's too
    assert straight_rng["python"] == killed_rng["python"]
    assert all(np.array_equal(x, y) for x, y in zip(straight_rng["numpy"], killed_rng["numpy"], strict=True))
    assert straight_rng["torch"].equal(killed_rng["torch"])
    rows = [json.loads(line) for line in (killed / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, len(rows) + 1))  # metrics continue without gaps or repeats
    # the goodput ledger: two attempts, the time between them a restart, the killed attempt's steps after the
    # checkpoint the second resumed from redone; what is kept adds up to the kept steps' own rows
    goodput = result["goodput"]
    assert goodput["attempts"] == 2 and goodput["restart_s"] > 0 and goodput["startup_s"] > 0
    assert goodput["redone_s"] >= 0 and goodput["evaluation_s"] > 0
    for bucket, phases in (("compute_s", ("forward_backward_s", "sync_s", "optimizer_s")),
                           ("data_wait_s", ("data_wait_s",)), ("checkpoint_s", ("checkpoint_s",))):
        assert goodput[bucket] == pytest.approx(sum(r.get(p, 0) for r in rows for p in phases), rel=1e-3, abs=1e-3)
    assert sum(v for k, v in goodput.items() if k.endswith("_s") and k != "total_s") == pytest.approx(
        goodput["total_s"])


def losses(workdir: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (workdir / "metrics.jsonl").read_text().splitlines()]


TRAIN_IN_ONE_PROCESS = """
import json, sys
from pathlib import Path
from compass.model.training.job import TrainJob
from compass.model.training.trainer import train_stage
for path in sys.argv[1:]:
    result = train_stage(TrainJob.read(Path(path)))
    print(json.dumps({"engine": result.setup.engine, "steps": result.steps, "resumed_from": result.resumed_from,
                      "final_loss": result.final_loss}))
"""


def test_a_deepspeed_stage_trains_and_resumes_in_a_process_no_launcher_started(stage1_job, tmp_path: Path):
    """Found on an H200 (tests/gpu): `train_stage` called directly, in a process without a launcher's LOCAL_RANK and
    rendezvous, failed in DeepSpeed's argument check, and a second engine in the process would have looked for MPI.
    The engine opens the rank's group of one itself; two stages in one process, the second resumed, both train.
    A third resumes from the stage's last step (what a retry finds after a failure past training: the export, a full
    disk at the commit): it trains nothing and reports the loss the stage ended on (it reported none, and the step
    failed reading its result)."""
    import shutil

    from compass.specs.how import Checkpoints

    straight, resumed, fresh, ended = tmp_path / "straight", tmp_path / "resumed", tmp_path / "fresh", tmp_path / "end"
    for folder in (straight, resumed, fresh, ended):
        folder.mkdir()
        job = stage1_job(folder, deepspeed=True, zero_stage=0)
        stage = job.recipe.stages[0].model_copy(update={"tokens": 12 * 4 * 64})  # 12 steps
        recipe = job.recipe.model_copy(update={"stages": [stage, *job.recipe.stages[1:]]})
        job.model_copy(update={"recipe": recipe}).with_how(
            precision="bf16", checkpoints=Checkpoints(every_steps=4, keep_last=2)).write(folder / "job.json")
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE",
                                                            "LOCAL_RANK") and not k.startswith(("SLURM_", "OMPI_"))}
    first = subprocess.run([sys.executable, "-c", TRAIN_IN_ONE_PROCESS, str(straight / "job.json")], cwd=REPO,
                           env=env, capture_output=True, text=True, timeout=600)
    assert first.returncode == 0, first.stderr[-4000:]
    older, last = sorted((straight / "checkpoints").glob("step-*"))  # kept: the last 2
    shutil.copytree(older, resumed / "checkpoints" / older.name)
    shutil.copytree(last, ended / "checkpoints" / last.name)
    again = subprocess.run([sys.executable, "-c", TRAIN_IN_ONE_PROCESS, str(resumed / "job.json"),
                            str(fresh / "job.json"), str(ended / "job.json")], cwd=REPO, env=env, capture_output=True,
                           text=True, timeout=600)
    assert again.returncode == 0, again.stderr[-4000:]
    runs = [json.loads(line) for line in again.stdout.splitlines() if line.startswith("{")]
    assert [(r["engine"], r["resumed_from"]) for r in runs] == [("deepspeed", int(older.name[5:])),
                                                                ("deepspeed", None), ("deepspeed", 12)], runs
    assert runs[2]["final_loss"] == runs[1]["final_loss"] == losses(straight)[-1]  # the loss it ended on
    assert losses(resumed) == losses(straight)[int(older.name[5:]):]  # the resume continues the run
    assert losses(fresh) == losses(straight)  # the second engine of the process trains like the first
