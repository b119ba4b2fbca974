"""The FSDP2 engine (`how.parallelism.engine: fsdp2`) on 2 CPU processes (gloo): torch's fully_shard per block trains
like one DDP process over a whole stage (losses, gradient norms, held-out loss, exported weights), its checkpoints
are torch.distributed.checkpoint shards written by every rank, a kill -9 mid-run resumes bitwise, and one rank
resumes what two wrote."""

from __future__ import annotations

import json
import logging
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.test_tensor_parallel import final_weights, kill_tree, launch, losses

FSDP2 = {"engine": "fsdp2", "deepspeed": False, "zero_stage": 0, "data_parallel": 2}
MOE = {"positions: {kind: rope, rope_theta: 10000}": "positions: {kind: rope, rope_theta: 10000}\n    family: moe\n"
       "    qk_norm: true\n    moe: {num_experts: 4, experts_per_token: 2, expert_ffn_size: 32}"}


@pytest.mark.slow
def test_two_fsdp2_ranks_train_like_one_process_and_resume_bitwise(stage1_job, tmp_path: Path):
    from compass.tasks.common.training import run_training

    single = run_training(stage1_job(tmp_path / "ddp", deepspeed=False, zero_stage=0), logging.getLogger("test"))
    sharded = run_training(stage1_job(tmp_path / "fsdp2", **FSDP2), logging.getLogger("test"))
    assert sharded.setup.engine == "fsdp2" and "2 ranks (2 data-parallel" in sharded.rank_check
    assert sharded.setup.sharding == "FSDP2 over 2 ranks"
    assert sharded.steps == single.steps >= 50
    assert losses(tmp_path / "fsdp2") == pytest.approx(losses(tmp_path / "ddp"), rel=1e-4)
    assert losses(tmp_path / "fsdp2", "grad_norm") == pytest.approx(losses(tmp_path / "ddp", "grad_norm"), rel=1e-3)
    assert sharded.val_loss == pytest.approx(single.val_loss, rel=1e-4)  # every rank joined the gathered forwards
    a, b = final_weights(tmp_path / "ddp"), final_weights(tmp_path / "fsdp2")  # written from the shards
    assert set(a) - set(b) <= {"lm_head.weight"}  # a tied head is saved once, under the embeddings' name
    assert all((a[k] - b[k]).abs().max() < 1e-4 for k in b)
    newest = sorted((tmp_path / "fsdp2" / "checkpoints").glob("step-*[0-9]"))[-1]
    assert {p.name for p in (newest / "dcp").iterdir()} >= {"__0_0.distcp", "__1_0.distcp", ".metadata"}

    killed = tmp_path / "killed"
    proc = launch(stage1_job(killed, **FSDP2), killed)
    deadline = time.monotonic() + 600
    while not (killed / "checkpoints" / "step-00000020" / "checksums.json").exists():  # the 2nd checkpoint
        assert proc.poll() is None and time.monotonic() < deadline, "training ended before the kill"
        time.sleep(0.05)
    kill_tree(proc)
    assert not (killed / "result.json").exists()
    newest = sorted((killed / "checkpoints").glob("step-*[0-9]"))[-1]
    step = int(newest.name.split("-")[1])
    # what a kill in the middle of DCP's background writes can leave: shards of a later step in its .tmp folder
    # (never committed), or, had a rank's file been cut after the commit, a damaged committed one
    torn = killed / "checkpoints" / f"step-{step + 3:08d}.tmp"
    shutil.copytree(newest, torn)
    (torn / "checksums.json").unlink()
    damaged = killed / "checkpoints" / f"step-{step + 5:08d}"
    shutil.copytree(newest, damaged)
    shard = damaged / "dcp" / "__1_0.distcp"
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    assert launch(stage1_job(killed, **FSDP2), killed).wait(600) == 0
    resumed = json.loads((killed / "result.json").read_text())
    assert resumed["resumed_from"] == step < resumed["steps"]  # the newest whole checkpoint, nothing later
    assert (killed / "checkpoints" / f"{damaged.name}.corrupt").exists()  # set aside, not taken
    straight, again = final_weights(tmp_path / "fsdp2"), final_weights(killed)
    assert all(straight[k].equal(again[k]) for k in straight)  # bitwise
    assert losses(killed)[-1] == losses(tmp_path / "fsdp2")[-1]

    # a checkpoint of 2 ranks resumed by 1 (a node lost): DCP reshards the weights and AdamW's states, the data
    # positions are kept per row of the global batch, so the next steps are the 2 ranks' steps
    mid = sorted((tmp_path / "fsdp2" / "checkpoints").glob("step-*[0-9]"))[0]
    alone = tmp_path / "alone"
    (alone / "checkpoints").mkdir(parents=True)
    shutil.copytree(mid, alone / "checkpoints" / mid.name)
    assert launch_ranks(stage1_job(alone, **{**FSDP2, "data_parallel": 1}), alone, ranks=1).wait(600) == 0
    assert json.loads((alone / "result.json").read_text())["resumed_from"] == int(mid.name.split("-")[1])
    two, one = losses(tmp_path / "fsdp2"), losses(alone)
    assert one[0] == pytest.approx(two[len(two) - len(one)], rel=1e-4)  # the step after the checkpoint
    assert one[-1] == pytest.approx(two[-1], rel=1e-3)


def launch_ranks(job, workdir: Path, ranks: int) -> subprocess.Popen:
    """The trainer under torchrun with `ranks` processes (a process of its own: no group left in the tests')."""
    from compass.infra.net import free_port

    workdir.mkdir(parents=True, exist_ok=True)
    job.write(workdir / "job.json")
    return subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks),
                             "--master-port", str(free_port()), "-m", "compass.model.training.trainer",
                             str(workdir / "job.json")], cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def test_the_engine_decides_deepspeed_and_what_fsdp2_cannot_take_is_refused(tmp_path: Path):
    from compass.specs.how import Parallelism
    from compass.specs.loader import SpecError, load_spec
    from tests.conftest import write_minimal_spec

    assert Parallelism.model_validate({"engine": "fsdp2"}).deepspeed is False
    assert Parallelism.model_validate({"engine": "fsdp2"}).sharding_stage == 3
    assert Parallelism().engine_name == "deepspeed" and Parallelism(deepspeed=False).engine_name == "ddp"
    for how, field, words in [
        ("{engine: fsdp2, deepspeed: true}", "how.parallelism", "disagree"),
        ("{engine: fsdp2, zero_stage: 2}", "how.parallelism.zero_stage", "zero_stage is DeepSpeed's"),
        ("{engine: deepspeed, shard_group: 2}", "how.parallelism.shard_group", "shard_group is FSDP2's"),
        ("{engine: ddp, reshard_after_forward: false}", "how.parallelism.reshard_after_forward", "is FSDP2's"),
        ("{engine: fsdp2, data_parallel: 3, shard_group: 2}", "how.parallelism.shard_group", "do not split"),
        ("{engine: fsdp2, tensor_parallel: 2, data_parallel: 1}", "how.parallelism.tensor_parallel",
         "the experts of a moe architecture are not split"),
    ]:
        folder = tmp_path / field.replace(".", "-") / str(len(how))
        folder.mkdir(parents=True)
        spec = write_minimal_spec(folder, **{"{micro_batch_size: 2}": how.replace("{", "{micro_batch_size: 2, ")},
                                  **(MOE if "moe" in words else {}))
        with pytest.raises(SpecError) as refused:
            load_spec(spec)
        assert field in str(refused.value) and words in str(refused.value), str(refused.value)


def test_the_plan_recommends_the_least_sharding_that_fits():
    """The playbook's rule (SmolLM3 kept ZeRO-0 at 384 GPUs): shard only as much as memory needs."""
    from compass.flows.reports.plan_tables import sharding_advice
    from compass.specs import costs
    from compass.specs.loader import load_spec
    from tests.conftest import REPO

    spec = load_spec(REPO / "tests" / "specs" / "minimal.yaml").spec
    device = costs.device_memory_bytes(spec.how)
    assert sharding_advice(spec, device) == ("recommended: no sharding (ZeRO-0 / DDP), the least sharding that fits; "
                                             "the spec's choice")
    fsdp2 = spec.how.parallelism.model_copy(update={"engine": "fsdp2", "deepspeed": False})
    sharded = spec.model_copy(update={"how": spec.how.model_copy(update={"parallelism": fsdp2})})
    assert sharding_advice(sharded, device).endswith("more sharding than needed (costs throughput)")
    four = spec.how.parallelism.model_copy(update={"data_parallel": 4})  # 4 ranks to shard over
    wide = spec.model_copy(update={"how": spec.how.model_copy(update={"parallelism": four})})
    hsdp = wide.how.parallelism.model_copy(update={"engine": "fsdp2", "deepspeed": False, "shard_group": 2})
    grouped = wide.model_copy(update={"how": wide.how.model_copy(update={"parallelism": hsdp})})
    assert costs.memory_per_gpu(grouped, 3).weights == 2 * costs.memory_per_gpu(wide, 3).weights  # 2 shards, not 4
    tight = costs.memory_per_gpu(wide, 3).total * 1.01  # only full sharding fits
    advice = sharding_advice(wide, tight)
    assert advice.startswith("recommended: ZeRO-3 or FSDP2") and advice.endswith("does not fit"), advice


@pytest.mark.slow
def test_fsdp2_composes_with_compile_and_activation_checkpointing(stage1_job, tmp_path: Path):
    """torch.compile, activation checkpointing and weights kept gathered between forward and backward
    (reshard_after_forward: false), all three at once under FSDP2's hooks: the same losses as the eager run, and
    dynamo's counters show the model was compiled (equal losses alone would pass without it)."""
    runs = {"eager": {}, "composed": {"activation_checkpointing": True, "reshard_after_forward": False}}
    for name, change in runs.items():
        job = stage1_job(tmp_path / name, **{**FSDP2, **change})
        recipe = job.recipe
        short = recipe.model_copy(update={"stages": [recipe.stages[0].model_copy(update={"tokens": 6 * 4 * 64})]})
        job = job.model_copy(update={"recipe": short}).with_how(compile=name == "composed")
        assert launch_ranks(job, tmp_path / name, ranks=2).wait(900) == 0, name
    assert losses(tmp_path / "composed") == pytest.approx(losses(tmp_path / "eager"), rel=1e-5)
    compiled = json.loads((tmp_path / "composed" / "result.json").read_text())["compiled"]
    assert compiled["graphs"] >= 1, compiled
    assert json.loads((tmp_path / "eager" / "result.json").read_text())["compiled"] is None


@pytest.mark.slow
def test_hsdp_shards_within_groups_and_replicates_across_them(stage1_job, tmp_path: Path):
    """shard_group 2 on 4 ranks: a 2 x 2 mesh (2 replicas, each sharded over 2 ranks, as the GPUs of 2 nodes) trains
    like one DDP process, and its checkpoint resumes on 2 ranks sharded as one group."""
    def short(job):
        recipe = job.recipe
        stage = recipe.stages[0].model_copy(update={"tokens": 20 * 4 * 64})
        return job.model_copy(update={"recipe": recipe.model_copy(update={"stages": [stage]})})

    hsdp = {**FSDP2, "data_parallel": 4, "shard_group": 2, "micro_batch_size": 1}
    assert launch_ranks(short(stage1_job(tmp_path / "ddp", deepspeed=False)), tmp_path / "ddp", 1).wait(900) == 0
    assert launch_ranks(short(stage1_job(tmp_path / "hsdp", **hsdp)), tmp_path / "hsdp", 4).wait(900) == 0
    assert losses(tmp_path / "hsdp") == pytest.approx(losses(tmp_path / "ddp"), rel=1e-4)
    # fp32 gradients reduced in another order (2 x 2 reduce-scatters and all-reduces vs one process): the norm
    # differs in its fourth digit (4.7e-4 at worst on the minimal spec's batches), but for the stage's last step, at
    # learning rate 0: 2.0e-3 since the windowed reads of d46ed11, as in the TP test (issue 74's note: to explain)
    hsdp_norms, ddp_norms = losses(tmp_path / "hsdp", "grad_norm"), losses(tmp_path / "ddp", "grad_norm")
    assert hsdp_norms[:-1] == pytest.approx(ddp_norms[:-1], rel=1e-3)
    assert hsdp_norms[-1] == pytest.approx(ddp_norms[-1], rel=3e-3)
    result = json.loads((tmp_path / "hsdp" / "result.json").read_text())
    assert "4 ranks (4 data-parallel" in result["rank_check"]
    assert result["setup"]["sharding"] == "HSDP: 2 replicas x 2 shards"  # the engine's device mesh

    two = resume_first_checkpoint(tmp_path / "hsdp", tmp_path / "two", 2,
                                  lambda folder: short(stage1_job(folder, **{**FSDP2, "micro_batch_size": 1})))
    assert losses(two)[-1] == pytest.approx(losses(tmp_path / "hsdp")[-1], rel=1e-4)


def resume_first_checkpoint(run: Path, folder: Path, ranks: int, job_in: Callable[[Path], object]) -> Path:
    """`folder` holding only the first checkpoint of `run`, trained to the end on `ranks` ranks from it."""
    first = sorted((run / "checkpoints").glob("step-*[0-9]"))[0]
    (folder / "checkpoints").mkdir(parents=True)
    shutil.copytree(first, folder / "checkpoints" / first.name)
    assert launch_ranks(job_in(folder), folder, ranks).wait(900) == 0
    assert json.loads((folder / "result.json").read_text())["resumed_from"] == int(first.name.split("-")[1])
    return folder


KEPT_OR_FREED = """
import sys, torch
from torch.distributed.tensor import DTensor
from compass.model.architecture import build_model, hf_config, parameter_groups
from compass.model.lm import CausalLMWithLoss
from compass.model.training.fsdp2 import FSDP2Engine
from compass.model.training.packing import make_batch
from compass.specs.architecture import Architecture
from compass.specs.training import Optimizer
import numpy as np

arch = Architecture(num_layers=2, hidden_size=32, ffn_size=64, num_heads=4, num_kv_heads=2)
lm = CausalLMWithLoss(build_model(hf_config(arch, 128, {"bos": 0, "eos": 0, "pad": 1}, 64), 3))
engine = FSDP2Engine(lm, lambda hf: parameter_groups(hf, 0.1, False), Optimizer(lr=1e-3), 1, "fp32",
                     reshard_after_forward=sys.argv[1] == "true")
tokens = np.random.default_rng(0).integers(2, 128, (1, 16))
loss, _ = engine(**make_batch(tokens, np.zeros_like(tokens)).inputs(torch.device("cpu")))
print(isinstance(lm.hf.model.layers[0].self_attn.q_proj.weight, DTensor))
"""


@pytest.mark.slow  # a process each, building and sharding a model
@pytest.mark.parametrize(("reshard", "sharded_between"), [("true", "True"), ("false", "False")])
def test_reshard_after_forward_decides_whether_a_block_stays_gathered_until_its_backward(reshard, sharded_between):
    done = subprocess.run([sys.executable, "-c", KEPT_OR_FREED, reshard], cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == sharded_between
