"""On a CUDA machine (`make test-gpu`): `compass preflight` on this node's GPUs, one rank per GPU on NCCL: bf16
matmul throughput, all-reduce bus bandwidth and NVML health measured and judged; and, with 2 GPUs or more,
tensor parallelism 2 over NCCL trains like one GPU."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import REPO, write_minimal_spec

pytestmark = pytest.mark.gpu


def gpus() -> int:
    if not torch.cuda.is_available():
        raise RuntimeError("make test-gpu needs a CUDA device: run it on a GPU node")
    return torch.cuda.device_count()


def on_gpus(job):
    """The job on 2 GPUs of this node."""
    if gpus() < 2:
        pytest.skip("tensor parallelism over NCCL needs 2 GPUs on this node")
    return job.with_how(hardware=job.hardware.model_copy(update={"accelerator": "h100", "devices_per_node": 2}))


def test_preflight_measures_every_gpu_of_this_node_on_nccl(tmp_path: Path):
    n = gpus()
    spec = write_minimal_spec(tmp_path, **{"how:\n": f"how:\n  hardware: {{accelerator: h100, devices_per_node: {n}}}\n"
                                                     f"  precision: bf16\n  storage: {{root: {tmp_path / 'store'}}}\n",
                                           "parallelism: {micro_batch_size: 2}":
                                           f"parallelism: {{micro_batch_size: 2, data_parallel: {n}}}",
                                           "global_batch_size: 4,": f"global_batch_size: {2 * n},"})
    done = subprocess.run([sys.executable, "-m", "compass.flows.cli.app", "preflight", str(spec), "--ranks", str(n),
                           "--duration", "5", "--megabytes", "64", "--json"], cwd=REPO, capture_output=True,
                          text=True, timeout=600)
    assert done.stdout.strip(), f"compass preflight exited {done.returncode} with no report:\n{done.stderr[-3000:]}"
    report = json.loads(done.stdout)
    rows = report["rows"]
    assert [r["rank"] for r in rows] == list(range(n))
    assert all(r["matmul_tflops"] > 50 for r in rows), rows  # bf16 dense: hundreds on an H100
    assert n == 1 or all(r["allreduce_busbw_gbps"] > 1 for r in rows), rows
    assert done.returncode in (0, 1) and (done.returncode == 0) == (report["exclude"] == ""), done.stderr[-2000:]


def test_tensor_parallel_2_on_nccl_trains_like_one_gpu(stage1_job, tmp_path: Path):
    from compass.tasks.common.training import run_training

    one = run_training(on_gpus(stage1_job(tmp_path / "tp1", deepspeed=True, zero_stage=1)), logging.getLogger("t"))
    two = run_training(on_gpus(stage1_job(tmp_path / "tp2", deepspeed=True, zero_stage=1, tensor_parallel=2)),
                       logging.getLogger("t"))
    assert "2 tensor-parallel" in two.rank_check and all(r.device.startswith("cuda") for r in two.ranks)
    losses = [[json.loads(line)["loss"] for line in (tmp_path / d / "metrics.jsonl").read_text().splitlines()]
              for d in ("tp1", "tp2")]
    assert losses[1] == pytest.approx(losses[0], rel=1e-3)
    assert two.val_loss == pytest.approx(one.val_loss, rel=1e-3)


def test_fsdp2_with_tensor_parallel_2_on_nccl_trains_like_fsdp2_alone(stage1_job, tmp_path: Path):
    """FSDP2's DTensor plans over NCCL (2 GPUs, fp32 so that the comparison is tight): TP 2 follows TP 1."""
    from compass.tasks.common.training import run_training

    fsdp2 = {"engine": "fsdp2", "deepspeed": False, "zero_stage": 0}
    one = run_training(on_gpus(stage1_job(tmp_path / "tp1", **fsdp2, data_parallel=2)), logging.getLogger("t"))
    two = run_training(on_gpus(stage1_job(tmp_path / "tp2", **fsdp2, data_parallel=1, tensor_parallel=2)),
                       logging.getLogger("t"))
    assert "2 tensor-parallel" in two.rank_check and two.setup.sharding.endswith("tensor-parallel 2")
    assert all(r.device.startswith("cuda") for r in two.ranks)
    losses = [[json.loads(line)["loss"] for line in (tmp_path / d / "metrics.jsonl").read_text().splitlines()]
              for d in ("tp1", "tp2")]
    assert losses[1] == pytest.approx(losses[0], rel=1e-3)
    assert two.val_loss == pytest.approx(one.val_loss, rel=1e-3)
