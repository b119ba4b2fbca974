"""Ablations judged on a benchmark, not only on the loss: each run's checkpoints are evaluated at probe points
during the short run, the comparison takes the metric's direction (accuracy: higher is better) and the seed spread,
and a metric no run can produce is refused when the spec is checked."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import run_up_to, seeded, write_minimal_spec

ABLATIONS = """  ablations:
    baseline: {tokens: 4096, sequence_length: 64, global_batch_size: 4, mixture: {notes: 0.7, code: 0.3}}
    variants:
      - {name: untied, change: {architecture.tied_embeddings: false}}
    seeds: [0, 1]
    metrics: ["arc_easy:cf/acc", "val_loss:notes"]
    probes: 1
  evaluation:
    benchmarks:
      - {name: arc_easy, formulation: cf, limit: 8}
    perplexity_sources: [notes]
  pretraining:"""


@pytest.mark.slow
def test_ablations_judged_on_a_benchmark_with_probes_during_the_run(data_store: Path, tmp_path: Path):
    spec = write_minimal_spec(tmp_path, **{"  pretraining:": ABLATIONS})
    _, outcomes = run_up_to(spec, "compare:ablations", seeded(tmp_path / "store", data_store))

    runs = {sid: o.manifest.metrics for sid, o in outcomes.items() if sid.startswith("ablate:")}
    assert len(runs) == 4
    for sid, metrics in runs.items():
        probes = metrics["probes"]
        assert len(probes) == 2 and probes[0]["tokens"] < probes[1]["tokens"] == metrics["tokens"], sid
        assert all(0.0 <= p["arc_easy:cf/acc"] <= 1.0 for p in probes)
        assert metrics["arc_easy:cf/acc"] == probes[-1]["arc_easy:cf/acc"]
        assert metrics["val_loss:notes"] == metrics["val_loss_by_source"]["notes"]

    out = Path(outcomes["compare:ablations"].uri)
    comparison = json.loads((out / "comparison.json").read_text())
    assert comparison["metric"] == "arc_easy:cf/acc"
    assert comparison["better_is"] == {"arc_easy:cf/acc": "higher", "val_loss:notes": "lower"}
    (row,) = comparison["rows"][1:]
    accs = {v: [runs[f"ablate:{v}-s{s}"]["arc_easy:cf/acc"] for s in (0, 1)] for v in ("baseline", "untied")}
    delta = sum(accs["untied"]) / 2 - sum(accs["baseline"]) / 2
    assert row["delta"] == round(delta, 4)
    diffs = [u - b for u, b in zip(accs["untied"], accs["baseline"], strict=True)]  # paired by seed
    half = 12.7062 * abs(diffs[0] - diffs[1]) / 2 ** 0.5 / 2 ** 0.5  # t(0.975, 1 df) x std of two / sqrt(2)
    low, high = sum(diffs) / 2 - half, sum(diffs) / 2 + half
    assert row["delta 95% interval"] == pytest.approx([round(low, 4), round(high, 4)], abs=1e-4)
    expected = "within noise" if low <= 0 <= high else ("better" if low > 0 else "worse")
    assert row["verdict"] == expected
    assert row["val_loss:notes verdict"] in ("better", "worse", "within noise")
    from compass.tasks.common.plots import PlotDescription

    panels = {p.title: p for p in PlotDescription.read(out / "probes.png").panels}
    assert set(panels) == {"arc_easy:cf/acc"}  # one line per variant: its probes' mean over the seeds
    drawn = {s.label: (s.x, s.y) for s in panels["arc_easy:cf/acc"].series}
    expected = {v: (tuple(float(p["tokens"]) for p in runs[f"ablate:{v}-s0"]["probes"]),
                    tuple((a["arc_easy:cf/acc"] + b["arc_easy:cf/acc"]) / 2 for a, b in
                          zip(runs[f"ablate:{v}-s0"]["probes"], runs[f"ablate:{v}-s1"]["probes"], strict=True)))
                for v in ("baseline", "untied")}
    assert drawn.keys() == expected.keys()
    assert all(drawn[v][0] == expected[v][0] and drawn[v][1] == pytest.approx(expected[v][1]) for v in expected)
    assert panels["arc_easy:cf/acc"].outside == []


def test_a_metric_no_run_produces_is_refused_at_validation(tmp_path: Path):
    from compass.flows.validation import load_checked
    from compass.specs.loader import SpecError

    spec = write_minimal_spec(tmp_path, **{"  pretraining:": ABLATIONS.replace('"arc_easy:cf/acc"', '"mmlu:mc/acc"')})
    with pytest.raises(SpecError) as raised:
        load_checked(spec, machine=False)
    (problem,) = [str(p) for p in raised.value.problems if "mmlu" in str(p)]
    assert "what.ablations.metrics[0]" in problem and "arc_easy:cf" in problem
