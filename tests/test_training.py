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
    steps = [json.loads(line)["step"] for line in (killed / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, len(steps) + 1))  # metrics continue without gaps or repeats
