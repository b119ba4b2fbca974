"""Multi-process launch: the commands built from `how.hardware` for torchrun and DeepSpeed's launcher, and two
"nodes" on this machine finding each other through torchrun's rendezvous to train one data-parallel stage."""

from __future__ import annotations

import json
import logging
import shlex
import sys
from pathlib import Path

import pytest

from compass.infra.launcher import plan_launch
from compass.infra.net import free_port
from compass.tasks.common.training import run_training
from tests.conftest import REPO


def test_torchrun_gets_one_launcher_per_node_over_ssh(tmp_path: Path):
    plan = plan_launch(tmp_path / "job.json", world=16, nodes=2, hosts=["10.0.0.1", "10.0.0.2"],
                       launcher="torchrun", port=29500, python="/venv/bin/python", cwd=Path("/srv/compass"))
    assert plan.hostfile is None and [c.host for c in plan.commands] == ["10.0.0.1", "10.0.0.2"]
    for rank, command in enumerate(plan.commands):
        ssh, options, batch, end, host, remote = command.argv  # "--": a host can never be read as an option
        assert (ssh, options, batch, end, host) == ("ssh", "-o", "BatchMode=yes", "--", f"10.0.0.{rank + 1}")
        cd, folder, conj, *argv = shlex.split(remote)
        assert (cd, folder, conj) == ("cd", "/srv/compass", "&&")
        assert argv == ["/venv/bin/python", "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(rank),
                        "--nproc-per-node", "8", "--master-addr", "10.0.0.1", "--master-port", "29500",
                        "-m", "compass.model.training.trainer", str(tmp_path / "job.json")]


def test_deepspeed_gets_a_hostfile_and_one_command_on_the_head_node(tmp_path: Path):
    plan = plan_launch(tmp_path / "job.json", world=4, nodes=2, hosts=["127.0.0.1", "gpu-b"], launcher="deepspeed",
                       port=29600, python=sys.executable, cwd=REPO)
    assert plan.hostfile == "127.0.0.1 slots=2\ngpu-b slots=2\n"
    (command,) = plan.commands
    assert command.argv == [sys.executable, "-m", "deepspeed.launcher.runner", "--hostfile",
                            str(tmp_path / "hostfile"), "--master_addr", "127.0.0.1", "--master_port", "29600",
                            "--num_nodes", "2", "--num_gpus", "2", "--module", "compass.model.training.trainer",
                            str(tmp_path / "job.json")]  # local head: no ssh


def test_ranks_must_spread_evenly_over_the_hosts(tmp_path: Path):
    with pytest.raises(ValueError, match="3 ranks cannot be spread evenly over 2 nodes"):
        plan_launch(tmp_path / "j", world=3, nodes=2, hosts=["a", "b"], launcher="torchrun", port=1, python="p",
                    cwd=tmp_path)
    with pytest.raises(ValueError, match="names 1 hosts for 2 nodes"):
        plan_launch(tmp_path / "j", world=2, nodes=2, hosts=["a"], launcher="torchrun", port=1, python="p",
                    cwd=tmp_path)


def test_deepspeed_launcher_accepts_the_generated_arguments(tmp_path: Path):
    """DeepSpeed's own argument parser reads the command compass builds (running it needs pdsh and GPUs)."""
    from deepspeed.launcher.runner import parse_args

    plan = plan_launch(tmp_path / "job.json", world=4, nodes=2, hosts=["a", "b"], launcher="deepspeed",
                       port=29600, python="python", cwd=tmp_path)
    argv = shlex.split(plan.commands[0].argv[-1].split("&& ", 1)[1])
    args = parse_args(argv[3:])
    assert (args.hostfile, args.master_addr, args.master_port, args.num_nodes, args.num_gpus, args.module) == (
        str(tmp_path / "hostfile"), "a", 29600, 2, 2, True)
    assert (args.user_script, args.user_args) == ("compass.model.training.trainer", [str(tmp_path / "job.json")])


@pytest.mark.slow
def test_two_nodes_on_this_machine_train_one_stage_together(stage1_job, tmp_path: Path):
    """Two torchrun launchers, one per "node", rendezvous on this machine and train ZeRO-1 data parallel."""
    job = stage1_job(tmp_path, deepspeed=True, zero_stage=1, data_parallel=2, micro_batch_size=2)
    hardware = job.hardware.model_copy(update={"nodes": 2, "hosts": ["127.0.0.1", "localhost"],
                                               "launcher": "torchrun", "rendezvous_port": free_port()})
    result = run_training(job.with_how(hardware=hardware), logging.getLogger("test"))
    assert result.rank_check == "2 ranks (2 data-parallel x 1 tensor-parallel): identical replicas, distinct data"
    assert {p.name for p in tmp_path.glob("launcher-*.log")} == {"launcher-0.log", "launcher-1.log"}
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["loss"] < rows[0]["loss"]
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf = sorted((tmp_path / "checkpoints").glob("step-*"))[-1] / "hf"  # rank 0's export loads as is
    model = AutoModelForCausalLM.from_pretrained(str(hf))
    ids = AutoTokenizer.from_pretrained(str(hf))("The old river", return_tensors="pt")["input_ids"]
    assert model(input_ids=ids).logits.shape[-1] == job.vocab_size


def test_a_rendezvous_port_is_never_one_the_kernel_hands_out():
    """A port from the ephemeral range can be handed to another process's connection between the pick and the
    rendezvous's bind (EADDRINUSE under load): free ports come from below that range, and are free."""
    import socket

    from compass.infra.net import first_ephemeral_port

    first_ephemeral = first_ephemeral_port()
    ports = {free_port() for _ in range(200)}
    assert len(ports) > 150 and all(20000 <= p < first_ephemeral for p in ports)
    with socket.socket() as taken:  # one in use is never handed out
        taken.bind(("127.0.0.1", min(ports)))
        assert min(ports) not in {free_port() for _ in range(500)}


ORPHANED_RANK = """
import os, subprocess, sys
# the launcher starts a rank and is gone before the rank has armed its parent-death signal (its imports take seconds)
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(1.5); "
                          "from compass.infra.die_with_parent import die_with_parent; "
                          "die_with_parent(never_a_child_of_init=True); time.sleep(60)"], start_new_session=True,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # the test reads this one's output
print(child.pid, flush=True)
os._exit(0)
"""


def test_a_rank_whose_launcher_died_before_it_armed_exits_instead_of_waiting_forever():
    """Found by benchmarks/chaos.py: TRL ranks of a run killed during their imports were adopted by init and waited
    in their rendezvous for good. The rank here arms 1.5 s after its launcher is gone: it must end at once, not
    after its 60 s."""
    import subprocess
    import time

    import psutil

    launcher = subprocess.run([sys.executable, "-c", ORPHANED_RANK], capture_output=True, text=True, timeout=60,
                              cwd=REPO)
    rank = psutil.Process(int(launcher.stdout.strip()))
    started = time.monotonic()
    try:
        rank.wait(timeout=30)  # not a child of this process: psutil polls it (psutil.TimeoutExpired if it lives on)
    finally:
        if rank.is_running():
            rank.kill()
    assert time.monotonic() - started < 30
