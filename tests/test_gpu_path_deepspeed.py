"""DeepSpeed's ZeRO stages on 2 CPU ranks, as the GPU path runs them: the gradient norm every monitor and metrics line
reads is the global one at every stage (ZeRO-2/3 partition the gradients; before, compass reported 0 there), and a
rollback in the middle of an accumulation leaves no trace (DeepSpeed's micro-batch count and ZeRO's reduced
partitions used to survive it). The ranks run tests/deepspeed_ranks.py."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import REPO
from tests.deepspeed_ranks import ACCUMULATION, STAGES, micro_batch, model


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from compass.infra.net import free_port

    out = tmp_path_factory.mktemp("deepspeed-ranks")
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                           "--master_port", str(free_port()), "-m", "tests.deepspeed_ranks", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return out


def reference_first_norm() -> float:
    """One process, full gradients: the mean over both ranks' micro-batches of the first step."""
    lm = model()
    for rank in (0, 1):
        for m in range(ACCUMULATION):
            loss, _ = lm(**micro_batch(0, rank, m).inputs(torch.device("cpu")))
            (loss / (2 * ACCUMULATION)).backward()
    return float(torch.nn.utils.get_total_norm([p.grad for p in lm.parameters() if p.grad is not None]))


@pytest.mark.slow  # 2 DeepSpeed ranks at each ZeRO stage: ~27 s
def test_the_grad_norm_is_the_global_one_at_every_zero_stage(ranks: Path):
    reports = [json.loads((ranks / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert reports[0] == reports[1]  # every rank reads the same number
    report = reports[0]
    expected = reference_first_norm()
    for stage in STAGES:
        before = report[str(stage)]["norm_before_step"]
        assert before[0] == pytest.approx(expected, rel=1e-5), f"ZeRO-{stage}"
        assert before == pytest.approx(report["0"]["norm_before_step"], rel=1e-5), f"ZeRO-{stage}"
        if stage >= 1:  # DeepSpeed's ZeRO optimizers keep the norm they clipped with: the same one
            assert report[str(stage)]["deepspeed_norm"] == pytest.approx(before, rel=1e-6), f"ZeRO-{stage}"


@pytest.mark.slow  # reads the module's 2-rank runs
def test_ranks_reduce_through_gloo_without_building_deepspeeds_shared_memory_op(ranks: Path):
    """The op's JIT build takes a file lock a killed rank leaves behind (every later start then waits forever);
    the compiler probe that would decide it is never run either."""
    for r in (0, 1):
        backend = json.loads((ranks / f"rank{r}.json").read_text())["backend"]
        assert backend == {"shm_comm_op": "None", "ops_probed": False}


@pytest.mark.slow  # reads the module's 2-rank runs
@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("run", ["rolled_back", "resumed"])
def test_a_rollback_or_a_resume_ends_at_the_weights_of_an_undisturbed_run(ranks: Path, stage: int, run: str):
    """rolled_back: a bad batch's micro-batches forwarded, then discarded and the checkpoint loaded mid-accumulation;
    resumed: the checkpoint loaded by a new engine. Both continue bitwise as if nothing happened."""
    weights = torch.load(ranks / f"zero{stage}-weights.pt")
    straight, other = weights["straight"], weights[run]
    assert straight.keys() == other.keys() and straight
    assert all(straight[k].equal(other[k]) for k in straight)  # bitwise


TWO_STARTS = """
import sys, threading, time
from compass.model.training.engines import import_deepspeed
found = {}
def second():  # starts once the first import has put its unfinished module in sys.modules
    while "deepspeed" not in sys.modules:
        time.sleep(0.0005)
    found["second"] = hasattr(import_deepspeed(), "initialize")  # whole when it is handed over
thread = threading.Thread(target=second)
thread.start()
found["first"] = hasattr(import_deepspeed(), "initialize")
thread.join()
print(found["first"], found["second"])
"""


def test_two_steps_of_one_process_starting_deepspeed_at_once_both_get_the_whole_module():
    """Two ablations run in threads of one process (max_parallel_steps: 2) import DeepSpeed together: the second
    waits for the first's import instead of taking the half-initialised module from sys.modules (CI: "module
    'deepspeed' has no attribute 'initialize'")."""
    done = subprocess.run([sys.executable, "-c", TWO_STARTS], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.splitlines()[-1] == "True True", done.stdout
