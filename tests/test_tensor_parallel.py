"""Tensor parallelism with DeepSpeed's AutoTP on 2 CPU processes (gloo): the same losses as one process, bitwise
resume after kill -9, and the start-of-run check that shards are slices of one initialisation."""

from __future__ import annotations

import json
import logging
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file

from compass.model.training.rank_checks import check_ranks, gathered_mismatch, state_digests
from tests.conftest import REPO


def test_rank_check_catches_tensor_parallel_ranks_seeded_alike():
    # (data-parallel rank, tensor-parallel rank, weights digest, batch digest) of 4 ranks: 2 x 2
    good = [(0, 0, 11, 100), (0, 1, 12, 100), (1, 0, 11, 200), (1, 1, 12, 200)]
    assert "2 data-parallel x 2 tensor-parallel" in check_ranks(good)
    with pytest.raises(RuntimeError, match="tensor-parallel ranks hold identical shards"):
        check_ranks([(0, 0, 11, 100), (0, 1, 11, 100)])  # SmolLM3's bug: every TP rank seeded alike
    with pytest.raises(RuntimeError, match="tensor-parallel peers received different batches"):
        check_ranks([(0, 0, 11, 100), (0, 1, 12, 101)])
    with pytest.raises(RuntimeError, match="data-parallel ranks start from different weights"):
        check_ranks([(0, 0, 11, 100), (1, 0, 13, 200)])
    with pytest.raises(RuntimeError, match="data-parallel ranks received identical batches"):
        check_ranks([(0, 0, 11, 100), (1, 0, 11, 100)])


def test_gathered_shards_are_compared_with_the_initial_weights():
    import torch

    initial = {"a": torch.arange(6.0).reshape(2, 3), "b": torch.ones(3)}
    digests = state_digests(initial)
    assert gathered_mismatch(digests, {k: v.clone() for k, v in initial.items()}) == []
    assert gathered_mismatch(digests, {"a": initial["a"] * 2, "b": initial["b"]}) == ["a"]


def losses(workdir: Path, field: str = "loss") -> list[float]:
    return [json.loads(line)[field] for line in (workdir / "metrics.jsonl").read_text().splitlines()]


def final_weights(workdir: Path) -> dict:
    last = sorted((workdir / "checkpoints").glob("step-*[0-9]"))[-1]
    return load_file(str(last / "hf" / "model.safetensors"))


def launch(job, workdir: Path) -> subprocess.Popen:
    from compass.infra.net import free_port

    workdir.mkdir(parents=True, exist_ok=True)
    job.write(workdir / "job.json")
    return subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
                             str(free_port()), "-m", "compass.model.training.trainer", str(workdir / "job.json")],
                            cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)


def kill_tree(proc: subprocess.Popen) -> None:
    """kill -9 the launcher and every rank (torchrun starts its workers in sessions of their own)."""
    import psutil

    procs = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
    for p in procs:
        p.send_signal(signal.SIGKILL)
    psutil.wait_procs(procs, timeout=30)


@pytest.mark.slow
def test_two_tensor_parallel_ranks_train_like_one_process_and_resume_bitwise(stage1_job, tmp_path: Path):
    from compass.tasks.common.training import run_training

    one = stage1_job(tmp_path / "tp1", deepspeed=True, zero_stage=1)
    single = run_training(one, logging.getLogger("test"))
    two = stage1_job(tmp_path / "tp2", deepspeed=True, zero_stage=1, tensor_parallel=2)
    result = run_training(two, logging.getLogger("test"))
    assert "1 data-parallel x 2 tensor-parallel" in result.rank_check
    assert "distinct shards" in result.rank_check and "shards gathered equal the initial weights" in result.rank_check
    assert losses(tmp_path / "tp2") == pytest.approx(losses(tmp_path / "tp1"), rel=1e-5)
    # the global gradient norm: each shard once, replicated weights once (it read 0 under tensor parallelism)
    assert losses(tmp_path / "tp2", "grad_norm") == pytest.approx(losses(tmp_path / "tp1", "grad_norm"), rel=1e-4)
    assert result.val_loss == pytest.approx(single.val_loss, rel=1e-5)
    a, b = final_weights(tmp_path / "tp1"), final_weights(tmp_path / "tp2")  # the export gathers the shards
    assert a.keys() == b.keys() and all(a[k].shape == b[k].shape for k in a)

    killed = tmp_path / "killed"
    proc = launch(stage1_job(killed, deepspeed=True, zero_stage=1, tensor_parallel=2), killed)
    deadline = time.monotonic() + 600
    while not (killed / "checkpoints" / "step-00000010" / "checksums.json").exists():
        assert proc.poll() is None and time.monotonic() < deadline, "training ended before the kill"
        time.sleep(0.05)
    kill_tree(proc)
    assert not (killed / "result.json").exists()
    assert launch(stage1_job(killed, deepspeed=True, zero_stage=1, tensor_parallel=2), killed).wait(600) == 0
    resumed = json.loads((killed / "result.json").read_text())
    assert 10 <= resumed["resumed_from"] < resumed["steps"]  # killed mid-run, resumed from a checkpoint
    assert "shards gathered equal the export of step-" in resumed["rank_check"]
    straight, resumed = final_weights(tmp_path / "tp2"), final_weights(killed)
    assert all(straight[k].equal(resumed[k]) for k in straight)  # bitwise
