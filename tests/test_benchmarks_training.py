"""The training benchmarks at a tiny size (a file of their own, so the suite's two workers share them)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.benchmark_script import bench


@pytest.mark.slow  # training runs, synchronous and in the background
def test_async_checkpoint(data_store: Path):
    out = bench("async_checkpoint.py", "--steps", "7", "--every", "3", "--rounds", "1", "--hidden", "64",
                "--layers", "2", prepared=data_store)
    assert "no checkpoints" in out and "async checkpoints" in out and "sync checkpoints" in out and "ratio" in out


@pytest.mark.slow
def test_pretrain_throughput(data_store: Path):  # the compiled variants' code path is tested in test_training_core
    out = bench("pretrain_throughput.py", "--steps", "6", "--warmup", "2", "--seq", "64", "--batch", "4",
                "--rounds", "1", "--variants",
                "bare torch loop,compass trainer,HF Trainer,HF Trainer with compass attention and loss",
                prepared=data_store)
    assert "compass trainer vs HF Trainer:" in out and "compass trainer vs HF Trainer with compass attention" in out


@pytest.mark.slow
def test_engines(data_store: Path):
    out = bench("engines.py", "--steps", "6", "--seq", "64", "--rounds", "1",  # each engine: tests/test_fsdp2*.py,
                "--engines", "FSDP2 + TP 2", prepared=data_store)  # test_gpu_path_zero.py; the script's one path
    assert "DDP" in out and "FSDP2 + TP 2" in out and "ratio" in out  # against the baseline, always run
    assert "ZeRO-1" not in out
