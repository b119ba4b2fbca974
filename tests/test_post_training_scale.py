"""TRL across ranks: SFT and DPO on 2 processes (gloo, torchrun) follow the loss curve of 1 process with the same
global batch, checkpoints at the spec's cadence are resumed after kill -9 to the undisturbed run's exact weights,
and validation refuses a global batch the ranks cannot split."""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from compass.model.training.records import CAUSES
from compass.tasks.post_training.trl_checkpoints import newest_complete
from tests.conftest import REPO, TRL_CHECKPOINTS, seeded, write_minimal_spec
from tests.watching import Watch

pytestmark = pytest.mark.slow

POST = """  post_training:
    - {method: sft, name: sft, dataset: "pypi://evals==3.0.1.post1", lr: 1.0e-3, max_samples: 48, max_length: 256,
       batch_size: 4}
    - {method: dpo, name: dpo, loss_type: sigmoid, dataset: prefs, lr: 1.0e-4, max_length: 64, batch_size: 2}
  pretraining:"""
PREFERENCES = [{"prompt": f"What is {a} + {a}?", "chosen": str(2 * a), "rejected": str(2 * a + 1)} for a in range(16)]
TRL_SHAPE = TRL_CHECKPOINTS + "  resources: {post_training: {devices_per_node: %d}}\n"

RUN_STEP = """
import logging, sys
from compass.flows.compiler import compile_spec
from compass.flows.runner import RunContext, run_step
from compass.infra.store import Store
from compass.specs import load_spec
from compass.tasks.steps.context import Runtime

logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(message)s")
loaded = load_spec(sys.argv[1])
plan = compile_spec(loaded.spec)
ctx = RunContext(plan, Store(sys.argv[2]), loaded.spec_hash, Runtime(how=loaded.spec.how, base_dir=loaded.base_dir))
run_step(ctx, plan.step(sys.argv[3]), logging.getLogger("step"))
"""


def spec_with_ranks(folder: Path, ranks: int, zero: int = 0) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "prefs").mkdir(exist_ok=True)
    (folder / "prefs" / "pairs.jsonl").write_text("".join(json.dumps(row) + "\n" for row in PREFERENCES))
    return write_minimal_spec(folder, **{"  pretraining:": POST, "how:\n": TRL_SHAPE % ranks,
                                         "{micro_batch_size: 2}": f"{{micro_batch_size: 2, zero_stage: {zero}}}"})


@pytest.fixture(scope="module")
def pretrained(trl_trained_store: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A store with the minimal spec's pretraining done (what every variant's SFT continues from)."""
    return seeded(tmp_path_factory.mktemp("trl-scale") / "store", trl_trained_store)


def run_steps(spec: Path, store: Path, steps: list[str]) -> dict:
    from compass.flows.compiler import compile_spec
    from compass.flows.runner import RunContext, run_step
    from compass.infra.store import Store
    from compass.specs import load_spec
    from compass.tasks.steps.context import Runtime

    loaded = load_spec(spec)
    plan = compile_spec(loaded.spec)
    ctx = RunContext(plan, Store(str(store)), loaded.spec_hash, Runtime(how=loaded.spec.how, base_dir=loaded.base_dir))
    return {s: run_step(ctx, plan.step(s), logging.getLogger("test")) for s in steps}


def ranks_alive(store: Path) -> list[int]:
    import psutil

    alive = []
    for process in psutil.process_iter(["pid", "cmdline"]):
        line = " ".join(process.info["cmdline"] or [])
        if "compass.tasks.post_training.trl_ranks" in line and str(store) in line:
            alive.append(process.info["pid"])
    return alive


def losses(outcome) -> list[float]:
    rows = [json.loads(line) for line in (Path(outcome.uri) / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if r.get("method") in ("sft", "dpo")]


def weights(outcome) -> dict:
    from safetensors.torch import load_file

    return load_file(str(Path(outcome.uri) / "final" / "model.safetensors"))


def sft_and_dpo(pretrained: Path, folder: Path, ranks: int, zero: int = 0,
                steps: tuple[str, ...] = ("post_train:sft", "post_train:dpo")) -> dict:
    store = folder / "store"
    shutil.copytree(pretrained, store)
    return run_steps(spec_with_ranks(folder, ranks, zero), store, list(steps))


class TargetWatch(Watch):
    """The Prometheus service-discovery files that appear under a folder while steps run (each rank registers its
    endpoint there while it trains and removes it when it ends)."""

    every_s = 0.02  # a DPO step of the test trains for about a second

    def __init__(self, folder: Path):
        super().__init__()
        self.folder, self.seen = folder, set()

    def sample(self) -> None:
        # the store's monitoring folder only (Store.monitoring_dir): a walk of the whole store took longer than the
        # DPO step's endpoint lived on a loaded machine and saw none of it
        self.seen |= {p.name for p in self.folder.glob("store/monitoring/*/targets/*.json")}


@pytest.fixture(scope="module")
def one_and_two_ranks(pretrained: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """SFT and DPO on 1 and on 2 ranks; "targets": the endpoints the 2 ranks registered while they trained."""
    runs: dict = {1: sft_and_dpo(pretrained, tmp_path_factory.mktemp("ranks1"), 1)}
    folder = tmp_path_factory.mktemp("ranks2")
    with TargetWatch(folder) as watch:
        runs[2] = sft_and_dpo(pretrained, folder, 2)
    runs["targets"] = watch.seen
    return runs


def test_each_rank_of_a_trl_step_serves_its_metrics_while_it_trains(one_and_two_ranks):
    """how.monitoring.prometheus reaches TRL's ranks: both ranks of each step registered an endpoint (and removed it:
    tests/test_observability.py checks what it serves)."""
    seen = one_and_two_ranks["targets"]
    for step in ("post_train_sft", "post_train_dpo"):
        assert {name.rsplit("-", 1)[-1] for name in seen if name.startswith(step)} == {"rank0.json", "rank1.json"}, seen


@pytest.fixture(scope="module")
def zero_ranks(pretrained: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict]:
    """SFT and DPO on 2 ranks sharded by DeepSpeed at ZeRO-3 (the spec's how.parallelism.zero_stage), and SFT at
    ZeRO-2 (DPO at ZeRO-2 proves nothing these do not: the same TRL trainer and DeepSpeed config, one stage less)."""
    return {3: sft_and_dpo(pretrained, tmp_path_factory.mktemp("zero3"), 2, 3),
            2: sft_and_dpo(pretrained, tmp_path_factory.mktemp("zero2"), 2, 2, steps=("post_train:sft",))}


def test_the_ranks_prepare_the_rows_once_and_load_what_rank_0_prepared(one_and_two_ranks):
    """Issue 73, M7: the rows reach the ranks as an on-disk dataset (trl_ranks.rows_dataset); TRL tokenizes (and,
    for SFT, builds labels for) it in rank 0 first, and rank 1 loads what rank 0 cached instead of preparing it on
    its own core: at SmolLM3's size, a 64k-token SFT set tokenized once, not on each of 8 ranks. DPO's length filter
    is the one map each rank runs again: TRL's filter closes over the rank's own training arguments, which enter
    its fingerprint (a pass over the prompts' lengths, not a tokenization)."""
    again = {"post_train:sft": 0, "post_train:dpo": 1}
    for step, rerun in again.items():
        one = one_and_two_ranks[1][step].manifest.metrics["rows_prepared"]
        two = one_and_two_ranks[2][step].manifest.metrics["rows_prepared"]
        assert set(one) == {"0"} and one["0"]["computed"] > 0, one
        assert set(two) == {"0", "1"}, two
        assert two["0"]["computed"] > 1 and two["0"]["loaded"] == 0, two
        assert two["1"] == {"computed": rerun, "loaded": two["0"]["computed"] - rerun}, two


def test_two_ranks_follow_one_rank_with_the_same_global_batch(one_and_two_ranks):
    for step in ("post_train:sft", "post_train:dpo"):
        one, two = one_and_two_ranks[1][step], one_and_two_ranks[2][step]
        assert one.manifest.metrics["ranks"] == 1 and two.manifest.metrics["ranks"] == 2
        assert one.manifest.metrics["steps"] == two.manifest.metrics["steps"] >= 3, step  # the same optimizer steps
        assert losses(two) == pytest.approx(losses(one), rel=2e-3, abs=2e-3), step
        assert one.manifest.metrics["tokens"] == two.manifest.metrics["tokens"], step  # every rank's tokens counted


@pytest.mark.parametrize("zero", [2, 3])
def test_ranks_sharded_by_zero_follow_one_rank(zero: int, zero_ranks, one_and_two_ranks):
    """The spec's ZeRO stage reaches the TRL ranks (DeepSpeed inside TRL's trainer: its checkpoints hold ZeRO's
    partitions), and sharding changes nothing but where the states live: the curve and the weights are those of
    one rank, at ZeRO-3 gathered for the export."""
    for step in zero_ranks[zero]:
        one, sharded = one_and_two_ranks[1][step], zero_ranks[zero][step]
        assert sharded.manifest.metrics["ranks"] == 2
        assert sharded.manifest.metrics["steps"] == one.manifest.metrics["steps"], step
        assert losses(sharded) == pytest.approx(losses(one), rel=2e-3, abs=2e-3), step
        got, want = weights(sharded), weights(one)
        assert got.keys() == want.keys()
        assert all(got[k].shape == want[k].shape and (got[k] - want[k]).abs().max() < 1e-3 for k in want), step
        assert sharded.manifest.metrics["zero_stage"] == zero  # as DeepSpeed's engine reports it
        assert "zero_stage" not in one.manifest.metrics


# both trainers, unsharded and sharded (checkpoints and resume are one path for SFT and DPO: trl_checkpoints)
@pytest.mark.parametrize(("step", "zero"), [("post_train:dpo", 0), ("post_train:sft", 2)])
def test_two_ranks_resume_after_kill_9_to_the_undisturbed_weights(step: str, zero: int, one_and_two_ranks, zero_ranks,
                                                                   pretrained: Path, tmp_path: Path):
    """kill -9 of the step's process and its ranks once a checkpoint is complete; the next attempt resumes from it
    (not from step 0; under ZeRO from DeepSpeed's partitions) and ends on the undisturbed run's exact weights."""
    spec = spec_with_ranks(tmp_path, 2, zero)
    store = tmp_path / "store"
    undisturbed = (zero_ranks[zero] if zero else one_and_two_ranks[2])[step]
    if step == "post_train:sft":
        shutil.copytree(pretrained, store)
    else:  # the undisturbed run's store up to SFT: DPO continues from the same weights
        shutil.copytree(Path(undisturbed.uri).parents[1], store)
        shutil.rmtree(store / "post_train" / Path(undisturbed.uri).name)  # not yet committed there
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-c", RUN_STEP, str(spec), str(store), step], cwd=REPO,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)
    deadline = time.monotonic() + 600
    while not list(store.rglob("trl-checkpoints/checkpoint-*/compass-complete")):
        assert proc.poll() is None, proc.stderr.read()[-3000:]
        assert time.monotonic() < deadline
        time.sleep(0.1)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    deadline = time.monotonic() + 30
    while ranks_alive(store):  # torchrun's ranks have sessions of their own: they die with their launcher
        assert time.monotonic() < deadline, f"ranks outlived the killed step: {ranks_alive(store)}"
        time.sleep(0.1)
    newest = newest_complete(next(store.rglob("trl-checkpoints")))
    resumed = run_steps(spec, store, [step])[step]
    assert resumed.manifest.metrics["resumed_from_step"] == int(newest.name.split("-")[1])
    # the goodput ledger saw both attempts: the time between the kill and the next start is restart time
    split, whole = resumed.manifest.metrics["goodput"], undisturbed.manifest.metrics["goodput"]
    assert split["attempts"] == 2 and split["restart_s"] > 0 and split["startup_s"] > 0 and split["compute_s"] > 0
    assert whole["attempts"] == 1 and whole["restart_s"] == whole["redone_s"] == 0 and whole["checkpoint_s"] > 0
    assert sum(split[f"{c}_s"] for c in CAUSES) + split["compute_s"] == pytest.approx(split["total_s"])
    got, want = weights(resumed), weights(undisturbed)
    assert got.keys() == want.keys() and all((got[k] == want[k]).all() for k in want)
    assert losses(resumed) == losses(undisturbed)  # the metrics history of the attempts before the kill is kept


def test_a_global_batch_the_ranks_cannot_split_is_refused(tmp_path: Path):
    from compass.flows.validation import load_checked
    from compass.specs.loader import SpecError

    spec = spec_with_ranks(tmp_path, 3)
    with pytest.raises(SpecError) as refused:
        load_checked(spec, machine=False)
    message = str(refused.value)
    assert "post_training" in message and "batch_size" in message and "does not split evenly" in message, message
