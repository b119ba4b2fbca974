"""The GPU planner (specs/scaling.py) against the SmolLM3 figures: 384 H100s (48 nodes, TP 2 x DP 192), about
24 days; the global batch caps data parallelism; a slow interconnect makes adding GPUs stop helping (Amdahl)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from compass.specs import load_spec, scaling
from tests.conftest import REPO

EXAMPLES = REPO / "specs" / "examples"


@pytest.fixture(scope="module")
def smollm3():
    return load_spec(EXAMPLES / "smollm3-3b.yaml").spec


def test_smollm3_on_384_h100s_takes_about_24_days(smollm3):
    days, exposed, capped = scaling.wall_days(smollm3, 384)
    assert days == pytest.approx(24, rel=0.10) and not capped
    assert exposed < 0.05  # 6 GB of gradients per replica hide behind the backward pass on 100 GB/s
    assert scaling.gpus_for(smollm3, 26) == 376  # 47 nodes of 8: pretraining's 11.1T tokens (the rest has its own)
    assert scaling.gpus_for(smollm3, 40) == 240  # 30 nodes
    assert scaling.gpus_for(smollm3, 20) is None  # 576 x 4k sequences per step: no more than 192 replicas


def test_the_global_batch_caps_data_parallelism(smollm3):
    points = scaling.scaling(smollm3)
    assert 384 in [p.gpus for p in points]
    knee = scaling.stops_helping(points)
    assert knee is not None and knee.capped and knee.gpus == 512


def test_a_slow_interconnect_makes_more_gpus_stop_helping(smollm3):
    hw = smollm3.how.hardware.model_copy(update={"internode_busbw_gbps": 2.0})
    slow = smollm3.model_copy(update={"how": smollm3.how.model_copy(update={"hardware": hw})})
    points = {p.gpus: p for p in scaling.scaling(slow)}
    assert points[8].exposed_comm_share == 0.0  # NVLink within one node
    assert points[256].exposed_comm_share > 0.3 and points[256].efficiency < 0.7
    knee = scaling.stops_helping(list(points.values()))
    assert knee is not None and not knee.capped and knee.gpus < 512
    fast, _, _ = scaling.wall_days(smollm3, 256)
    assert scaling.wall_days(slow, 256)[0] > 1.3 * fast


@pytest.mark.slow  # two plans of the SmolLM3 example through the CLI
def test_plan_uses_measured_throughput_from_a_preflight_report(tmp_path: Path):
    spec = tmp_path / "spec.yaml"
    text = (EXAMPLES / "smollm3-3b.yaml").read_text()
    hub = "{kind: hub, repo: meta-llama/Llama-3.2-1B, vocab_size: 128256}"  # not in this machine's HF cache
    spec.write_text(text.replace("assumed_mfu: 0.3}", "assumed_mfu: 0.3, target_days: 26}")
                    .replace(hub, "{kind: bpe, vocab_size: 128256}"))
    report = tmp_path / "preflight.json"
    rows = [{"node": f"n{i}", "rank": i, "matmul_tflops": 296.7, "allreduce_busbw_gbps": 90.0} for i in range(8)]
    report.write_text(json.dumps({"rows": rows}))  # matmuls at half of a healthy H100's: training at half speed
    command = [sys.executable, "-m", "compass.flows.cli.app", "plan", str(spec), "--no-machine-checks", "--json"]
    assumed = json.loads(subprocess.run(command, capture_output=True, text=True, cwd=REPO, check=True).stdout)
    measured = json.loads(subprocess.run([*command, "--preflight", str(report)], capture_output=True, text=True,
                                         cwd=REPO, check=True).stdout)

    def section(plan: dict) -> dict:
        return next(s for s in plan["sections"] if s["title"] == "GPUs and wall time")

    a, m = section(assumed), section(measured)
    assert any("target 26 days: 376 GPUs (47 nodes of 8)" in n for n in a["notes"])
    assert any("target 26 days: no GPU count reaches it" in n for n in m["notes"])
    assert "measured by preflight" in m["notes"][0] and "148 TFLOP/s" in m["notes"][0]


def test_plan_shows_each_phase_on_its_own_gpus_and_days(tmp_path: Path):
    """The SmolLM3 example as published: pretraining on 48 nodes, long context on 3 (DP 12 x TP 2), ablations on
    one node, post-training on one node of 8, evaluation on one GPU; each stage's days on its phase's GPUs."""
    from tests.hub_cache import llama_like_tokenizer, seed_model

    cache = tmp_path / "hub"
    seed_model(cache, "meta-llama/Llama-3.2-1B", llama_like_tokenizer(tmp_path / "tokenizer"))
    env = {**os.environ, "HF_HUB_CACHE": str(cache)}
    done = subprocess.run([sys.executable, "-m", "compass.flows.cli.app", "plan", str(EXAMPLES / "smollm3-3b.yaml"),
                           "--no-machine-checks", "--json"], capture_output=True, text=True, cwd=REPO, env=env,
                          check=True)
    sections = {s["title"]: s for s in json.loads(done.stdout)["sections"]}
    placed = {row[0]: row for row in sections["Where each phase runs"]["rows"]}
    assert {phase: (row[1], row[3]) for phase, row in placed.items()} == {
        "data": (1, 0), "ablation": (1, 8), "pretraining": (48, 384), "long context": (3, 24),
        "mid training": (48, 384), "post training": (1, 8), "evaluation": (1, 1)}
    assert all(row[-1] == "Slurm job" for phase, row in placed.items() if phase != "data")
    assert placed["data"][-1] == "Slurm jobs; curation and tokenization as job arrays of 1-CPU tasks"
    compute = {row[0]: row for row in sections["Training compute"]["rows"]}
    columns = sections["Training compute"]["columns"]
    gpus, days = columns.index("GPUs"), columns.index("days")
    assert compute["pretrain:stage1"][gpus] == 384 and compute["long_context:ctx32k"][gpus] == 24
    pretraining = sum(float(compute[f"pretrain:stage{i}"][days]) for i in (1, 2, 3))
    assert pretraining == pytest.approx(25, rel=0.10)  # published: 24 days on 384 H100s
    long_context = float(compute["long_context:ctx32k"][days]) + float(compute["long_context:ctx64k"][days])
    assert 5 < long_context < 20  # 99B tokens at 32-64k on 24 GPUs
    predicted = {row[0]: row for row in sections["Goodput (predicted)"]["rows"]}
    assert set(predicted) == set(compute) - {"total"}  # every training stage
    assert all(90 < float(row[-1].rstrip("%")) < 100 for row in predicted.values())


@pytest.mark.parametrize("command", ["validate", "plan"])
def test_checking_and_planning_a_cpu_spec_load_no_model_library(command: str, tmp_path: Path):
    """Validation imports torch only for what the spec asks of it (a GPU, flash attention, the liger loss): every
    validate, plan, run and submit of a CPU spec paid 3 s of torch's import before."""
    record = tmp_path / "record.json"
    done = subprocess.run([sys.executable, "-m", "tests.watched_cli", str(record), command,
                           str(EXAMPLES / "tiny.yaml")], capture_output=True, text=True, cwd=REPO, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(record.read_text())["heavy_modules"] == []


def with_how(spec, section: str, **changes):
    """The spec with fields of one how section changed."""
    how = spec.how.model_copy(update={section: getattr(spec.how, section).model_copy(update=changes)})
    return spec.model_copy(update={"how": how})


def test_the_predicted_goodput_counts_checkpoints_interruptions_and_their_costs(smollm3):
    """The plan's predicted split of each training stage (the causes a run's ledger measures): SmolLM3's stage 1,
    3.45M steps checkpointed every 2,000 on 48 nodes for ~18 days, expects ~3.5 interruptions at 0.004 per node-day;
    twice the failure rate doubles them and their restarts; synchronous checkpoints stall for the whole write."""
    from compass.specs.costs import stage_costs
    from compass.specs.goodput_plan import predicted_splits

    splits = {p.stage: p for p in predicted_splits(smollm3)}
    assert set(splits) == {f"{c.section}:{c.name}" for c in stage_costs(smollm3)}
    cost = next(c for c in stage_costs(smollm3) if c.name == "stage1")
    stage1 = splits["pretrain:stage1"]
    assert stage1.compute_s == pytest.approx(cost.gpu_hours / 384 * 3600)
    batch = smollm3.what.pretraining.stages[0].global_batch_size * cost.seq_len
    assert stage1.checkpoints == -(-int(cost.tokens // batch) // smollm3.how.checkpoints.every_steps)
    assert stage1.interruptions == pytest.approx((stage1.compute_s + stage1.checkpoint_s) / 86400 * 48 * 0.004)
    assert 2 < stage1.interruptions < 5 and 0.95 < stage1.goodput < 1
    assert stage1.restart_s == pytest.approx(stage1.interruptions * smollm3.how.hardware.requeue_s)
    flaky = {p.stage: p for p in predicted_splits(with_how(smollm3, "hardware", node_failures_per_day=0.008))}
    assert flaky["pretrain:stage1"].interruptions == pytest.approx(2 * stage1.interruptions, rel=1e-3)
    assert flaky["pretrain:stage1"].goodput < stage1.goodput
    blocking = {p.stage: p for p in predicted_splits(with_how(smollm3, "checkpoints", asynchronous=False))}
    assert blocking["pretrain:stage1"].checkpoint_s > 5 * stage1.checkpoint_s
