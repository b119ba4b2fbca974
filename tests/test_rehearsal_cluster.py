"""The production launch rehearsed on an emulated GPU cluster: two Slurm nodes on this machine, each declaring two
GPUs as GRES (tests/slurm_cluster.py), so Slurm sets CUDA_VISIBLE_DEVICES, SLURM_LOCALID and SLURMD_NODENAME per
task exactly as on GPU nodes. The minimal spec's first pretraining stage runs the way the SmolLM3 spec trains:
DeepSpeed in bf16 at ZeRO-0 with TP 2, on 2 nodes x 2 GPUs, node-local staging, `launch: srun` (and torchrun),
submitted by `compass run`. The ranks compute on the CPU (no CUDA here) and record the GPU each would open.

Before: the launch bound a GPU per task (`--gpus-per-task=1 --gpu-bind=closest`), so every rank's GPU was its
`cuda:0` while DeepSpeed and DDP open `cuda:LOCAL_RANK`; srun exported no LOCAL_WORLD_SIZE, so node 0 staged the
rows of every node; and the bf16 start-of-run checks crashed before the first step."""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest

from compass.infra.store import Store
from tests.conftest import REPO, VENV_BIN, base_env, seeded, write_minimal_spec

pytestmark = pytest.mark.slow

NODES, GPUS = 2, 2


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
  parallelism: {deepspeed: true, zero_stage: 0, data_parallel: 2, tensor_parallel: 2, micro_batch_size: 1}
  precision: bf16
  storage: {local_cache: CACHE}
  orchestration: {cluster: {kind: slurm, poll_seconds: 0.5, shared_root: SHARED, launch: LAUNCH}}
"""


def rehearse(tmp_path: Path, data_store: Path, launch: str, engine: str = "deepspeed: true, zero_stage: 0") -> dict:
    """`compass run` of the first pretraining stage, the SmolLM3 spec's `how` at 2 x 2 GPUs; its manifest's metrics."""
    spec = write_minimal_spec(tmp_path, **{"how:\n  parallelism: {micro_batch_size: 2}\n": "",
                                           "tokens: 20000, sequence_length: 64": "tokens: 2048, sequence_length: 64"})
    how = PRODUCTION_HOW.replace("CACHE", str(tmp_path / "node-scratch")).replace("SHARED", str(tmp_path / "shared"))
    spec.write_text(spec.read_text() + how.replace("LAUNCH", launch).replace("deepspeed: true, zero_stage: 0", engine))
    seeded(tmp_path / "store", data_store)
    env = base_env(tmp_path / "prefect")
    done = subprocess.run([str(VENV_BIN / "compass"), "run", str(spec), "--store", str(tmp_path / "store"),
                           "--until", "pretrain:stage1", "--json"], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=840)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    step = next(s for s in json.loads(done.stdout)["steps"] if s["step"] == "pretrain:stage1")
    assert step["executed"]
    manifest = Store(str(tmp_path / "store")).read_manifest(step["uri"])
    assert manifest.execution.mode == "in_slurm_job" and manifest.execution.nodes == NODES
    return {"metrics": manifest.metrics, "log": done.stderr}  # the job's log streams into the step's


def assert_production_ranks(metrics: dict, log: str, engine: str = "deepspeed") -> None:
    ranks = metrics["ranks"]
    assert len(ranks) == NODES * GPUS
    by_node: dict[str, list[dict]] = {}
    for rank in ranks:
        by_node.setdefault(rank["node"], []).append(rank)
    assert sorted(by_node) == ["node1", "node2"], ranks  # Slurm's nodes, not this host's name
    for node, on_node in by_node.items():
        assert sorted(r["local_rank"] for r in on_node) == list(range(GPUS)), (node, on_node)
        assert sorted(r["gpu"] for r in on_node) == ["0", "1"], (node, on_node)  # distinct visible GPUs per node
        for rank in on_node:
            assert rank["device"] == f"cpu (would open cuda:{rank['local_rank']} (GPU {rank['gpu']}))", rank
            assert rank["visible"] == ["0", "1"], rank  # Slurm's list of the node's GPUs, not unset, not one
    setup = metrics["setup"]
    assert (setup["engine"], setup["precision"]) == (engine, "bf16"), setup
    # the start-of-run checks read the bf16 weights DeepSpeed holds (before: numpy has no bfloat16, a TypeError)
    assert metrics["parallel"] == ("4 ranks (2 data-parallel x 2 tensor-parallel): identical replicas, distinct data, "
                                   "distinct shards; shards gathered equal the initial weights")
    # each node stages the rows of its own ranks: node 1 the first half, node 2 the second (LOCAL_WORLD_SIZE 2)
    staged = sorted(set(re.findall(r"for rows (\d+)-(\d+) of (\d+)", log)))
    assert staged == [("0", "1", "4"), ("2", "3", "4")], staged


def test_the_production_launch_with_srun_puts_every_rank_on_its_own_gpu(gpu_cluster, data_store: Path,
                                                                        tmp_path: Path):
    result = rehearse(tmp_path, data_store, "srun")
    assert_production_ranks(result["metrics"], result["log"])


def test_the_production_launch_with_torchrun_puts_every_rank_on_its_own_gpu(gpu_cluster, data_store: Path,
                                                                            tmp_path: Path):
    result = rehearse(tmp_path, data_store, "torchrun")
    assert_production_ranks(result["metrics"], result["log"])


def test_the_production_launch_with_fsdp2_puts_every_rank_on_its_own_gpu(gpu_cluster, data_store: Path,
                                                                          tmp_path: Path):
    result = rehearse(tmp_path, data_store, "srun", engine="engine: fsdp2")
    assert_production_ranks(result["metrics"], result["log"], engine="fsdp2")
