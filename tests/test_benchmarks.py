"""Every benchmark runs at a tiny size, so none can rot unseen: each exits 0 and prints its ratio lines (the
numbers themselves are not asserted: tests never judge wall-clock time)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.benchmark_script import bench
from tests.conftest import REPO


@pytest.mark.slow  # a curation step end to end, twice
def test_curation_throughput(tmp_path: Path):
    out = bench("curation_throughput.py", "--spec", str(REPO / "tests/specs/minimal.yaml"), "--source", "notes",
                "--rounds", "1", "--store", str(tmp_path / "store"))
    assert "datatrove" in out and "compass" in out and "ratio" in out


@pytest.mark.slow  # each variant in a process of its own, at two lengths: about a minute
def test_long_sequence_memory():
    out = bench("long_sequence_memory.py", "--lengths", "128,256", "--rows", "1")
    assert "growth 128 -> 256 tokens" in out and "dense mask" in out


def test_loss_memory():
    out = bench("loss_memory.py", "--tokens", "512", "--vocab", "4096", "--hidden", "32")
    assert "chunked needs" in out and "less memory" in out


@pytest.mark.slow  # each side builds its index of MMLU and HellaSwag (datatrove's tokenizes with spaCy: ~30 s)
def test_decontamination_throughput():
    out = bench("decontamination_throughput.py", "--pages", "60", "--planted", "6", "--rounds", "1",
                "--items", "400")
    assert "datatrove NGramsDecont" in out and "compass fence" in out and "planted pages found" in out


def test_gpu_throughput_says_it_needs_cuda_where_there_is_none():
    """With no GPU visible (on a CUDA host too: this file runs in `make test`), the GPU benchmark says so."""
    out = bench("gpu_throughput.py", env={"CUDA_VISIBLE_DEVICES": ""}, records=False)
    assert out.strip() == "no CUDA device: skipped"


@pytest.mark.slow  # three processes (two variants and the matmul peak), each building the model: about a minute
def test_gpu_throughputs_cpu_path_runs_the_same_code_at_a_tiny_size():
    """`--tiny`: the benchmark's own code (job, trainer, bare loop, MFU against a measured matmul peak) on the CPU
    at a toy shape with torch's varlen attention, so a first GPU session does not meet its bugs; its result file is
    its own (gpu_throughput-tiny), never in place of a GPU's numbers."""
    out = bench("gpu_throughput.py", "--tiny", "--steps", "6", "--warmup", "2", "--rounds", "1", "--attention",
                "varlen", "--variants", "bare torch loop,compass trainer", env={"CUDA_VISIBLE_DEVICES": ""})
    assert "measured compass trainer" in out and "CPU throughput" in out and "attention varlen" in out, out
    assert "MFU (median): bare torch loop" in out and "fp32, uncompiled (--tiny)" in out


@pytest.mark.gpu
def test_gpu_throughput_measures_the_trainer_against_a_bare_loop_on_cuda():
    out = bench("gpu_throughput.py", "--steps", "4", "--warmup", "2", "--rounds", "1", "--variants",
                "bare torch loop,compass trainer")
    assert "measured compass trainer" in out and "MFU" in out
