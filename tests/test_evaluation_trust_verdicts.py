"""Ablation verdicts with statistics (issue 44, item 4): a variant is better or worse only when the 95% interval of
its difference from the baseline, paired by seed, excludes 0; one seed gives "one seed: no noise estimate" (it once
gave noise 0, so every difference read as better or worse), and the plan warns about it."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
from typer.testing import CliRunner

from compass.infra.store import Store
from compass.tasks.kinds.ablate import ONE_SEED, CompareConfig, delta_interval, run_comparison, verdict
from compass.tasks.steps.context import InputArtifact, Runtime, StepContext
from tests.conftest import write_minimal_spec
from tests.test_store import manifest_for


def test_the_interval_is_paired_by_seed_and_decides_the_verdict():
    base = {0: 3.00, 1: 3.20, 2: 3.10}
    consistent = {0: 2.90, 1: 3.11, 2: 2.99}  # 0.09-0.11 lower on every seed, though the seeds spread by 0.2
    low, high = delta_interval(base, consistent)
    assert low < high < 0
    assert verdict((low, high), lower_is_better=True) == "better"
    assert verdict((low, high), lower_is_better=False) == "worse"
    noisy = {0: 2.80, 1: 3.35, 2: 3.10}
    assert verdict(delta_interval(base, noisy), lower_is_better=True) == "within noise"
    assert delta_interval({0: 3.0}, {0: 2.0}) is None and verdict(None, lower_is_better=True) == ONE_SEED


def compare(tmp_path: Path, runs: dict[str, float]) -> dict:
    """The compare step on committed ablation runs `{step name: val_loss}`, as the flow runs it."""
    store = Store(str(tmp_path / "store"))
    inputs = {}
    for name, loss in runs.items():
        manifest = manifest_for(store, "ablate", name, name.encode().hex().ljust(64, "0")[:64],
                                metrics={"val_loss": loss})
        inputs[name] = InputArtifact(name, f"ablate:{name}", manifest.uri, manifest, store)
    seeds = sorted({int(n.rpartition("-s")[2]) for n in runs})
    out = tmp_path / "out"
    out.mkdir()
    ctx = StepContext("compare", "ablations", CompareConfig(metrics=["val_loss"], seeds=seeds), inputs, out, out, out,
                      Runtime(), logging.getLogger("test"))
    result = run_comparison(ctx)
    assert json.loads((out / "comparison.json").read_text())["rows"] == result.metrics["rows"]
    return {row["variant"]: row for row in result.metrics["rows"]}


def test_one_seed_says_it_has_no_noise_estimate(tmp_path: Path):
    rows = compare(tmp_path, {"baseline-s0": 3.0, "untied-s0": 2.5})
    assert rows["untied"]["verdict"] == ONE_SEED and rows["untied"]["delta 95% interval"] is None
    assert rows["untied"]["delta"] == -0.5


def test_two_seeds_carry_their_interval(tmp_path: Path):
    rows = compare(tmp_path, {"baseline-s0": 3.0, "baseline-s1": 3.2, "untied-s0": 2.9, "untied-s1": 3.1})
    assert rows["untied"]["delta 95% interval"] == pytest.approx([-0.1, -0.1], abs=1e-9)  # the same on both seeds
    assert rows["untied"]["verdict"] == "better"


def test_the_plan_warns_that_one_seed_gives_no_noise_estimate(tmp_path: Path):
    from compass.flows.cli.app import app

    ablations = ("  ablations:\n    baseline: {tokens: 4096, sequence_length: 64, global_batch_size: 4, "
                 "mixture: {notes: 0.7, code: 0.3}}\n    variants:\n      - {name: untied, change: "
                 "{architecture.tied_embeddings: false}}\n    seeds: [0]\n  pretraining:")
    done = CliRunner().invoke(app, ["plan", str(write_minimal_spec(tmp_path, **{"  pretraining:": ablations})),
                                    "--store", str(tmp_path / "store"), "--json"])
    assert done.exit_code == 0, done.output
    (section,) = [s for s in json.loads(done.stdout)["sections"] if s["title"] == "Ablations"]
    assert any(note.startswith("seeds: [0]: one seed gives no noise estimate") for note in section["notes"])


def report_on(tmp_path: Path, right: int, of: int, threshold: float) -> dict:
    """The success report on a committed evaluation scoring `right` of `of` items of arc_easy, as the flow runs it."""
    from compass.specs.why import SuccessCriterion
    from compass.tasks.evaluation.scores import ITEMS, ItemScore
    from compass.tasks.kinds.success_report import ReportConfig, run_success_report

    store = Store(str(tmp_path / "store"))
    items = [ItemScore(item=str(i), metrics={"acc": float(i < right)}) for i in range(of)]
    manifest = manifest_for(store, "evaluate", "pretrain-stage1", f"{right:02d}{of:02d}".ljust(64, "0"),
                            metrics={"arc_easy:cf/acc": right / of})
    with store.staging() as out:
        (out / ITEMS).write_text(json.dumps({"arc_easy:cf": [i.model_dump() for i in items]}))
        manifest = store.commit(out, manifest)
    inputs = {"eval:pretrain:stage1": InputArtifact("eval:pretrain:stage1", "evaluate:pretrain-stage1", manifest.uri,
                                                    manifest, store)}
    out = tmp_path / f"out-{right}-{of}-{threshold}"
    out.mkdir()
    config = ReportConfig(criteria=[SuccessCriterion(metric="arc_easy:cf/acc", threshold=threshold)],
                          final="pretrain:stage1")
    result = run_success_report(StepContext("report", "success", config, inputs, out, out, out, Runtime(),
                                            logging.getLogger("test")))
    assert json.loads((out / "report.json").read_text())["criteria"] == result.metrics["criteria"]
    return result.metrics


def test_a_criterion_passes_or_fails_only_when_its_interval_over_the_items_clears_the_threshold(tmp_path: Path):
    """0.6 measured on 10 items meets 0.5 by its point estimate only: the 95% interval over the items (about
    0.3-0.9) straddles it. On 400 items the same score is 0.55-0.65: a pass; against 0.7, a fail."""
    few = report_on(tmp_path, 6, 10, 0.5)
    (row,) = few["criteria"]
    assert row["verdict"] == "within noise" and not few["passed"] and "straddles 0.5" in row["note"]
    low, high = row["interval"]
    assert low < 0.5 < 0.6 < high
    many = report_on(tmp_path, 240, 400, 0.5)
    assert many["criteria"][0]["verdict"] == "pass" and many["passed"]
    assert 0.5 < many["criteria"][0]["interval"][0] < 0.6 < many["criteria"][0]["interval"][1] < 0.7
    assert report_on(tmp_path, 240, 400, 0.7)["criteria"][0]["verdict"] == "fail"
