"""Every benchmark runs at a tiny size, so none can rot unseen: each exits 0 and prints its ratio lines (the
numbers themselves are not asserted: tests never judge wall-clock time)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO

BENCH = REPO / "benchmarks"


def bench(script: str, *args: str, timeout: int = 900) -> str:
    done = subprocess.run([sys.executable, script, *args], cwd=BENCH, capture_output=True, text=True,
                          timeout=timeout)
    assert done.returncode == 0, f"{script} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done.stdout


def test_curation_throughput(tmp_path: Path):
    out = bench("curation_throughput.py", "--spec", str(REPO / "tests/specs/minimal.yaml"), "--source", "notes",
                "--rounds", "1", "--store", str(tmp_path / "store"))
    assert "datatrove" in out and "compass" in out and "ratio" in out


def test_long_sequence_memory():
    out = bench("long_sequence_memory.py", "--lengths", "128,256", "--rows", "1")
    assert "growth 128 -> 256 tokens" in out and "dense mask" in out


def test_loss_memory():
    out = bench("loss_memory.py", "--tokens", "512", "--vocab", "4096", "--hidden", "32")
    assert "chunked needs" in out and "less memory" in out


def test_async_checkpoint():
    out = bench("async_checkpoint.py", "--steps", "6", "--every", "3", "--rounds", "1", "--hidden", "64",
                "--layers", "2")
    assert "async" in out and "sync" in out and "ratio" in out


def test_gpu_throughput_skips_without_cuda():
    out = bench("gpu_throughput.py")
    assert out.strip() == "no CUDA device: skipped"


@pytest.mark.slow
def test_pretrain_throughput():  # the compiled variants' code path is tested in test_training_core
    out = bench("pretrain_throughput.py", "--steps", "6", "--warmup", "2", "--seq", "64", "--batch", "4",
                "--rounds", "1", "--variants", "bare torch loop,compass trainer,HF Trainer")
    assert "compass trainer vs HF Trainer" in out


@pytest.mark.slow
def test_evaluation_throughput():
    out = bench("evaluation_throughput.py", "--samples", "8", "--rounds", "1")
    assert "lighteval directly" in out and "compass evaluate step" in out


@pytest.mark.slow
def test_cached_rerun():
    out = bench("cached_rerun.py", "--rounds", "1", "--until", "ingest")
    assert "cached re-run" in out and "ratio vs full run" in out


@pytest.mark.slow
def test_submission_overhead():
    out = bench("submission_overhead.py", "--rounds", "1", "--until", "ingest")
    assert "compass submit --watch" in out and "ratio" in out


@pytest.mark.slow
def test_engines():
    out = bench("engines.py", "--steps", "6", "--seq", "64", "--rounds", "1",  # each engine: tests/test_fsdp2*.py,
                "--engines", "DeepSpeed ZeRO-3", "FSDP2 + TP 2")                  # test_gpu_path_zero.py
    assert "DeepSpeed ZeRO-3" in out and "FSDP2 + TP 2" in out and "ratio" in out
    assert "ZeRO-1" not in out


@pytest.mark.slow
def test_data_throughput():
    out = bench("data_throughput.py", "--files", "2", "--documents", "50", "--rounds", "1")
    assert "compass, 2 workers" in out and "tokens/s from 1 to 2 workers" in out
