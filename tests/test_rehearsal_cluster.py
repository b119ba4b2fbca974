"""The production launch rehearsed on an emulated GPU cluster: two Slurm nodes on this machine, each declaring two
GPUs as GRES (tests/slurm_cluster.py), so Slurm sets CUDA_VISIBLE_DEVICES, SLURM_LOCALID and SLURMD_NODENAME per
task exactly as on GPU nodes. The minimal spec's first pretraining stage runs the way the SmolLM3 spec trains:
DeepSpeed in bf16 at ZeRO-1 with TP 2, on 2 nodes x 2 GPUs, node-local staging, with `launch: torchrun` (and FSDP2
with srun), submitted by `compass run`. The ranks compute on the CPU (no CUDA here) and record the GPU each would
open. The spec's own launch (`srun`) is rehearsed on the SmolLM3 spec itself, with `compass run --rehearse`
(tests/test_production.py).

Before: the launch bound a GPU per task (`--gpus-per-task=1 --gpu-bind=closest`), so every rank's GPU was its
`cuda:0` while DeepSpeed and DDP open `cuda:LOCAL_RANK`; srun exported no LOCAL_WORLD_SIZE, so node 0 staged the
rows of every node; and the bf16 start-of-run checks crashed before the first step."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from compass.infra.store import Store
from tests.conftest import REPO, VENV_BIN, base_env, seeded, write_minimal_spec
from tests.rehearsal_checks import GPUS, NODES, assert_production_ranks

pytestmark = pytest.mark.slow

def test_each_emulated_node_gives_its_tasks_its_own_gpus(gpu_cluster):
    """What the rehearsal relies on: Slurm, not the test, sets each task's GPUs, local id and node name."""
    show = 'echo "$SLURMD_NODENAME $SLURM_LOCALID ${CUDA_VISIBLE_DEVICES-unset}"'
    out = srun(gpu_cluster, f"--nodes={NODES}", f"--ntasks-per-node={GPUS}", f"--gpus-per-node={GPUS}", show)
    assert sorted(out.splitlines()) == ["node1 0 0,1", "node1 1 0,1", "node2 0 0,1", "node2 1 0,1"]
    for per_task in (["--gpus-per-task=1"], ["--gpus-per-task=1", "--gpu-bind=closest"]):  # main's flags: each
        bound = srun(gpu_cluster, "--nodes=1", "--ntasks=2", *per_task, show)  # task sees one GPU, as its cuda:0
        assert sorted(line.split()[2] for line in bound.splitlines()) == ["0", "1"], per_task
    unbound = srun(gpu_cluster, "--nodes=1", "--ntasks=2", "--gpus-per-node=2", "--gpu-bind=none", show)
    assert {line.split()[2] for line in unbound.splitlines()} == {"unset"}  # every GPU of the node, others' too


def srun(env: dict[str, str], *args: str) -> str:
    """A command's output on the cluster's nodes (srun with the given shape, a CPU per task)."""
    done = subprocess.run(["srun", "--cpus-per-task=1", *args[:-1], "bash", "-c", args[-1]], env={**os.environ, **env},
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout


PRODUCTION_HOW = """how:
  hardware: {accelerator: h100, nodes: 2, devices_per_node: 2}
  parallelism: {deepspeed: true, zero_stage: 1, data_parallel: 2, tensor_parallel: 2, micro_batch_size: 1}
  precision: bf16
  storage: {local_cache: CACHE}
  orchestration: {cluster: {kind: slurm, poll_seconds: 0.5, shared_root: SHARED, launch: LAUNCH}}
"""


def rehearse(tmp_path: Path, data_store: Path, api_url: str, launch: str,
             engine: str = "deepspeed: true, zero_stage: 1") -> dict:
    """`compass run` of the first pretraining stage, the SmolLM3 spec's `how` at 2 x 2 GPUs; its manifest's metrics."""
    spec = write_minimal_spec(tmp_path, **{"how:\n  parallelism: {micro_batch_size: 2}\n": "",
                                           "tokens: 20000, sequence_length: 64": "tokens: 2048, sequence_length: 64"})
    how = PRODUCTION_HOW.replace("CACHE", str(tmp_path / "node-scratch")).replace("SHARED", str(tmp_path / "shared"))
    spec.write_text(spec.read_text() + how.replace("LAUNCH", launch).replace("deepspeed: true, zero_stage: 1", engine))
    seeded(tmp_path / "store", data_store)
    env = base_env(tmp_path / "prefect") | {"PREFECT_API_URL": api_url}
    done = subprocess.run([str(VENV_BIN / "compass"), "run", str(spec), "--store", str(tmp_path / "store"),
                           "--until", "pretrain:stage1", "--json"], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=840)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    step = next(s for s in json.loads(done.stdout)["steps"] if s["step"] == "pretrain:stage1")
    assert step["executed"]
    manifest = Store(str(tmp_path / "store")).read_manifest(step["uri"])
    assert manifest.execution.mode == "in_slurm_job" and manifest.execution.nodes == NODES
    return {"metrics": manifest.metrics, "log": done.stderr}  # the job's log streams into the step's


def test_the_production_launch_with_torchrun_puts_every_rank_on_its_own_gpu(gpu_cluster, data_store: Path,
                                                                            prefect_server: str, tmp_path: Path):
    result = rehearse(tmp_path, data_store, prefect_server, "torchrun")
    assert_production_ranks(result["metrics"], result["log"])


def test_the_production_launch_with_fsdp2_puts_every_rank_on_its_own_gpu(gpu_cluster, data_store: Path,
                                                                          prefect_server: str, tmp_path: Path):
    result = rehearse(tmp_path, data_store, prefect_server, "srun", engine="engine: fsdp2")
    assert_production_ranks(result["metrics"], result["log"], engine="fsdp2")
