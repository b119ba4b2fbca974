"""Ablations end to end on the fixture corpus: variant and seed runs, the comparison with noise, and
`compass ablate promote` writing the next baseline."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from tests.conftest import REPO, Cli, base_env, seeded

pytestmark = pytest.mark.slow

ABLATIONS = """  ablations:
    baseline: {tokens: 8000, sequence_length: 64, global_batch_size: 4, mixture: {notes: 0.7, code: 0.3}}
    variants:
      - {name: untied, change: {architecture.tied_embeddings: false}}
      - {name: more_code, change: {mixture: {notes: 0.5, code: 0.5}}}
    seeds: [0, 1]
  pretraining:"""


def test_ablation_runs_comparison_and_promotion(trained_store: Path, tmp_path: Path):
    from compass.flows.compiler import compile_spec
    from compass.flows.runner import RunContext, run_step
    from compass.infra.store import Store
    from compass.specs import load_spec
    from compass.tasks.steps.context import Runtime

    spec = tmp_path / "spec.yaml"
    spec.write_text((REPO / "tests" / "specs" / "minimal.yaml").read_text()
                    .replace("../fixtures/", f"{REPO}/tests/fixtures/").replace("  pretraining:", ABLATIONS))
    loaded = load_spec(spec)
    plan = compile_spec(loaded.spec)
    store = seeded(tmp_path / "store", trained_store)  # the data and the main stages committed: the ablations run
    ctx = RunContext(plan, Store(str(store)), loaded.spec_hash,
                     Runtime(how=loaded.spec.how, base_dir=loaded.base_dir))
    outcomes = {s.id: run_step(ctx, s, logging.getLogger("test")) for s in plan.steps}
    runs = [o.manifest for sid, o in outcomes.items() if sid.startswith("ablate:")]
    assert len(runs) == 6  # (baseline + 2 variants) x 2 seeds
    untied = [m for m in runs if m.name.startswith("untied")]
    assert all(m.metrics["change"] == {"architecture.tied_embeddings": False} for m in untied)
    assert all(m.metrics["setup"]["engine"] and m.metrics["setup"]["substituted"] == [] for m in runs)  # as trained
    seeds = {m.name: m.metrics["val_loss"] for m in runs}
    assert seeds["baseline-s0"] != seeds["baseline-s1"]  # seeds differ: the noise is measured, not assumed

    comparison = json.loads((Path(outcomes["compare:ablations"].uri) / "comparison.json").read_text())
    rows = {r["variant"]: r for r in comparison["rows"]}
    assert set(rows) == {"baseline", "untied", "more_code"}
    base = (seeds["baseline-s0"] + seeds["baseline-s1"]) / 2
    assert rows["baseline"]["val_loss"] == pytest.approx(base, abs=1e-4)
    assert rows["untied"]["delta"] == pytest.approx(rows["untied"]["val_loss"] - rows["baseline"]["val_loss"],
                                                    abs=2e-4)
    from compass.tasks.common.plots import PlotDescription

    (panel,) = PlotDescription.read(Path(outcomes["compare:ablations"].uri) / "comparison.png").panels
    # one bar per variant from zero (the baseline), as tall as its difference, its verdict and interval on it
    assert panel.ylabel.startswith(f"{comparison['metric']} minus the baseline's") and "lower is better" in panel.ylabel
    assert panel.bars == pytest.approx({v: r["delta"] for v, r in rows.items() if v != "baseline"}, abs=1e-6)
    assert [t.split("\n")[0] for t in panel.texts] == [rows[v]["verdict"] for v in panel.bars]
    assert panel.ylim[0] <= 0 <= panel.ylim[1] and panel.outside == []  # zero and each bar's top within the axes

    cli = Cli(tmp_path, base_env(tmp_path / "prefect-home"))
    out = tmp_path / "next.yaml"
    cli("ablate", "promote", str(spec), "--variant", "untied", "--out", str(out), "--store", str(store))
    promoted = load_spec(out).spec
    assert promoted.what.architecture.tied_embeddings is False
    assert [v.name for v in promoted.what.ablations.variants] == ["more_code"]
    import difflib  # the file as written, changed only where the promotion changes it: a diff to review, not a rewrite

    changed = [line for line in difflib.unified_diff(spec.read_text().splitlines(), out.read_text().splitlines(),
                                                     lineterm="", n=0)
               if line[:1] in "+-" and not line.startswith(("+++", "---"))]
    assert 2 <= len(changed) <= 3 and all("tied_embeddings" in line for line in changed), changed
    done = cli("ablate", "promote", str(spec), "--variant", "nope", "--store", str(store), check=False)
    assert done.returncode == 2 and "no variant 'nope'" in done.stderr

    # without --variant the committed comparison decides: the largest improvement beyond noise, or nothing
    auto = cli("ablate", "promote", str(spec), "--store", str(store), "--out", str(tmp_path / "auto.yaml"),
               check=False)
    better = sorted((r for r in comparison["rows"] if r["verdict"] == "better"), key=lambda r: r["delta"])
    if better:
        assert auto.returncode == 0 and f"promoted '{better[0]['variant']}'" in auto.stdout
    else:
        assert auto.returncode == 2 and "nothing to promote" in auto.stderr


@pytest.mark.parametrize(("metric", "rows", "expected"), [
    ("val_loss", [("baseline", 0.0, "baseline"), ("a", -0.10, "better"), ("b", -0.30, "better"),
                  ("c", -0.50, "within noise")], "b"),
    ("arc_easy:cf/acc", [("baseline", 0.0, "baseline"), ("a", 0.02, "better"), ("b", 0.05, "better"),
                         ("c", -0.01, "worse")], "b"),
    ("val_loss", [("baseline", 0.0, "baseline"), ("a", -0.01, "within noise"), ("b", 0.2, "worse")], None),
])
def test_auto_promote_takes_the_largest_gain_beyond_noise_or_nothing(metric, rows, expected):
    """Each comparison decides one outcome: the largest gain in the metric's direction among 'better' variants (a
    bigger drop that is within noise does not count), or nothing to promote."""
    from compass.flows.cli.promote import PromoteError, winner
    from compass.tasks.common.comparison import ComparedVariant, Comparison

    comparison = Comparison(metric=metric, rows=[ComparedVariant(variant=v, delta=d, verdict=k) for v, d, k in rows])
    if expected is None:
        with pytest.raises(PromoteError, match="nothing to promote"):
            winner(comparison)
    else:
        assert winner(comparison) == expected
