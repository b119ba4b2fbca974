"""A researcher's day (issue 75): one run of `compass validate` says everything wrong with a spec, each mistake once
and where it is written, with a fix that fits it."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from compass.flows.validation import load_checked
from compass.specs.evaluation import COMPASS_BENCHMARKS
from compass.specs.loader import SpecError
from tests.conftest import FIXTURES, write_minimal_spec

EVALUATION = "  pretraining:\n    schedule"  # where an evaluation section goes in the minimal spec


def with_evaluation(folder: Path, benchmarks: str, criterion: str | None = None, **more: str) -> Path:
    edits = {EVALUATION: f"  evaluation:\n    benchmarks: {benchmarks}\n    perplexity_sources: [notes]\n"
                         f"{EVALUATION}", **more}
    if criterion is not None:
        edits["{metric: val_ppl:notes, op: \"<=\", threshold: 1000, checkpoint: final}"] = criterion
    return write_minimal_spec(folder, **edits)


def problems(spec: Path) -> list[str]:
    with pytest.raises(SpecError) as info:
        load_checked(spec)
    return [str(p) for p in info.value.problems]


def test_three_mistakes_in_three_sections_come_out_in_one_run(tmp_path: Path):
    """A field the schema refuses (how), a source path that is not there (what.data: a machine check) and a
    misspelled benchmark (what.evaluation: a cross-field rule): before, the schema's problem alone, then the
    benchmark's, then the path's, three tries. `compass validate` exits 2 and writes nothing."""
    spec = with_evaluation(tmp_path, "[{name: arc_easyy}]", **{
        "corpus/code": "corpus/cod",
        "parallelism: {micro_batch_size: 2}": "parallelism: {micro_batch_size: 2, zero_stage: 7}"})
    text = spec.read_text().splitlines()
    line = {needle: next(i for i, t in enumerate(text, 1) if needle in t)
            for needle in ("corpus/cod", "arc_easyy", "zero_stage")}
    found = problems(spec)
    assert len(found) == 3, found
    path, benchmark, field = found
    assert path.startswith(f"{spec}:{line['corpus/cod']}: what.data.sources[1].uri: local source")
    assert "corpus/cod' does not exist" in path
    assert benchmark.startswith(f"{spec}:{line['arc_easyy']}: what.evaluation.benchmarks[0].name: 'arc_easyy' is not")
    assert "did you mean 'arc_easy'?" in benchmark
    assert field.startswith(f"{spec}:{line['zero_stage']}: how.parallelism.zero_stage: Input should be 0, 1, 2 or 3")

    done = subprocess.run([sys.executable, "-m", "compass.flows.cli.app", "validate", str(spec)], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "3 problems" in done.stderr and "nothing was run or written" in done.stderr
    assert [line for line in done.stderr.splitlines() if line.startswith(str(spec))] == found
    assert sorted(p.name for p in tmp_path.iterdir()) == ["spec.yaml"]  # no store, no .compass


def test_a_misspelled_benchmark_is_said_once_where_it_is_written(tmp_path: Path):
    """The criterion names the benchmark as it should be (arc_easy:cf/acc), the suite misspells it: one problem, at
    the benchmark, with the name meant. Before, the first problem was the criterion's, whose hint listed the
    misspelled `arc_easyy:cf/<metric>` as what the suite gives."""
    spec = with_evaluation(tmp_path, "[{name: arc_easyy}]",
                           '{metric: "arc_easy:cf/acc", op: ">=", threshold: 0.3, checkpoint: final}')
    (only,) = problems(spec)
    assert "what.evaluation.benchmarks[0].name: 'arc_easyy' is not a benchmark compass has offline data for" in only
    assert "did you mean 'arc_easy'?" in only and "arc_easyy:cf" not in only.split("(", 1)[1]


def test_a_criterion_on_a_benchmark_not_in_the_suite_lists_only_what_the_suite_gives(tmp_path: Path):
    spec = with_evaluation(tmp_path, "[{name: arc_easy}, {name: piqa, formulation: gen}]",
                           '{metric: "hellaswag:cf/acc", op: ">=", threshold: 0.3, checkpoint: final}')
    criterion, formulation = problems(spec)  # in file order: the criterion is written first
    assert "what.evaluation.benchmarks[1].formulation: piqa has no 'gen' formulation (use formulation: cf or mcf)" \
        in formulation
    assert "why.success_criteria[0].metric: no evaluation produces the metric 'hellaswag:cf/acc'" in criterion
    given = criterion.split("the evaluation suite gives: ", 1)[1]
    assert "arc_easy:cf/<metric>" in given and "piqa" not in given  # a benchmark written wrong gives nothing


def test_what_a_refused_field_leaves_to_its_default_is_not_judged(tmp_path: Path):
    """Benchmarks written as bare names (the schema wants mappings): the schema's problem is said; the checks that
    run on the rest see an empty suite in its place, and what they would say of it (the criterion that reads the
    suite) is left out rather than blamed on the researcher."""
    spec = with_evaluation(tmp_path, "[arc_easy]",
                           '{metric: "arc_easy:cf/acc", op: ">=", threshold: 0.3, checkpoint: final}',
                           **{"corpus/code": "corpus/cod"})
    found = problems(spec)
    assert len(found) == 2, found
    assert "what.data.sources[1].uri: local source" in found[0]
    assert "what.evaluation.benchmarks[0]: Input should be a valid dictionary or instance of Benchmark" in found[1]


def test_the_spec_names_the_benchmarks_compass_holds_data_for():
    """The spec's vocabulary of compass benchmarks (specs/evaluation.py) is the offline data's (tasks/evaluation)."""
    from compass.tasks.evaluation.offline_benchmarks import BENCHMARKS, GENERATIVE, VERIFIED

    assert set(COMPASS_BENCHMARKS) == {*BENCHMARKS, *GENERATIVE, *VERIFIED}
    assert all(COMPASS_BENCHMARKS[name] == ("gen",) for name in [*GENERATIVE, *VERIFIED])



def record_source(tmp_path: Path, files: dict[str, bytes], format: str = "jsonl", text_key: str = "text") -> Path:
    """The minimal spec with its code source replaced by a folder of record files."""
    data = tmp_path / "data"
    data.mkdir()
    for name, body in files.items():
        (data / name).write_bytes(body)
    return write_minimal_spec(tmp_path, **{
        f'uri: {FIXTURES}/corpus/code\n        include: ["*.py"]\n        format: code':
        f'uri: {data}\n        include: ["*.{format}"]\n        format: {format}\n        text_key: {text_key}'})


def records(n: int, key: str = "text") -> bytes:
    return b"".join(json.dumps({key: f"document {i} " * 10, "id": i}).encode() + b"\n" for i in range(n))


def test_a_broken_line_in_a_pretraining_source_is_refused_at_validate_where_it_is(tmp_path: Path):
    """Before, `compass validate` passed and the run stopped 9 s in, at ingest, saying to run again. The line is
    past the first records every file gets read for: the source's few files are each read further."""
    spec = record_source(tmp_path, {"a.jsonl": records(40), "b.jsonl": records(30) + b'{"text": "cut sho\n' +
                                    records(3)})
    (problem,) = problems(spec)
    assert f"what.data.sources[1].uri: {tmp_path}/data/b.jsonl:31: not a JSON record" in problem
    assert "fix or remove that line, or leave the file out with exclude" in problem and "run again" not in problem


def test_records_without_the_text_key_are_refused_with_the_keys_they_have(tmp_path: Path):
    (problem,) = problems(record_source(tmp_path, {"a.jsonl": records(5, key="content")}))
    assert "a.jsonl: no record among its first lines has the key 'text' (the first has: content, id)" in problem
    assert "set text_key to the key holding the text" in problem
    (tmp_path / "fixed").mkdir()
    fixed = record_source(tmp_path / "fixed", {"a.jsonl": records(5, key="content")}, text_key="content")
    assert load_checked(fixed).spec.what.data.sources[1].text_key == "content"


def test_a_parquet_source_without_its_text_column_is_refused(tmp_path: Path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"body": ["a document"] * 4}), tmp_path / "t.parquet")
    (problem,) = problems(record_source(tmp_path, {"t.parquet": (tmp_path / "t.parquet").read_bytes()}, "parquet"))
    assert "t.parquet: has no column 'text' (its columns: body)" in problem


def test_validation_opens_a_bounded_number_of_a_large_sources_files(tmp_path: Path):
    """A source of many files has FILES_CHECKED of them checked, spread over it (the broken one among them here:
    the last file), not every one: validation stays seconds long at millions of files."""
    from compass.tasks.data import source_check

    files = {f"f{i:05d}.jsonl": records(2) for i in range(3 * source_check.FILES_CHECKED)}
    spread = source_check._spread(sorted(files), source_check.FILES_CHECKED)
    assert len(spread) == source_check.FILES_CHECKED and spread[0] == "f00000.jsonl"
    files[spread[-1]] = b"not json\n"
    (problem,) = problems(record_source(tmp_path, files))
    assert f"{spread[-1]}:1: not a JSON record" in problem


@pytest.mark.slow  # the session's trained store
def test_why_explains_each_step_once_where_inputs_share_a_cause(trained_store: Path, tmp_path: Path):
    """One tokenizer field edited: the first stage's three changed inputs all trace back to the tokenizer. Before,
    its cause came out under each of them (three times here; eight in a 20-line answer for a larger plan)."""
    from tests.conftest import seeded
    from tests.test_identity import why

    store = seeded(tmp_path / "store", trained_store)
    spec = write_minimal_spec(tmp_path, **{"train_chars: 100000": "train_chars: 100001"})
    answer = why("pretrain:stage2", str(spec), "--store", str(store)).splitlines()
    steps = [line.split()[0] for line in answer]
    assert len(steps) == len(set(steps)) and {"tokenizer:select", "tokenize:code", "tokenize:notes",
                                                "pretrain:stage1"} <= set(steps)
    said = [line.strip() for line in answer if "train_chars 100000 -> 100001" in line]
    assert said == ["tokenizer:select runs: config changed: train_chars 100000 -> 100001"]


QUIRKY_ABLATIONS = """  ablations:
    # the proxy every variant changes one thing of
    baseline: {tokens:   8000, sequence_length: 64, global_batch_size: 4, mixture: {notes: 0.7,code: 0.3}}
    variants:
      # untied embeddings: does the small model need the extra parameters?
      - {name: untied, change: {architecture.tied_embeddings: false}}
      - name: 'more_code'    # more code in the mix
        change: {mixture: {notes: 0.5, code: 0.5}}
    seeds: [0, 1]     # two seeds: a paired interval
  pretraining:"""


def test_promote_changes_exactly_the_promoted_line_and_the_variants_own(tmp_path: Path):
    """The spec as its author wrote it (odd spacing, a quoted name, comments above and beside): the promoted field
    is the one line that changes, and the variant's lines (its comment with it) are the ones removed. A load and
    dump rewrote the baseline's spacing, the quoted name and the comment columns."""
    import difflib

    from compass.flows.cli.promote import promote

    spec = write_minimal_spec(tmp_path, **{"  pretraining:": QUIRKY_ABLATIONS})
    before = spec.read_text().splitlines()
    comment, untied = (f"-{line}" for line in QUIRKY_ABLATIONS.splitlines()[4:6])
    more_code = [f"-{line}" for line in QUIRKY_ABLATIONS.splitlines()[6:8]]
    baseline = "    baseline: {tokens:   8000, sequence_length: 64, global_batch_size: 4, mixture: {notes: %s}}"
    for variant, expected in (("untied", ["+    tied_embeddings: false", comment, untied]),
                              ("more_code", [f"-{baseline % '0.7,code: 0.3'}", f"+{baseline % '0.5, code: 0.5'}",
                                             *more_code])):
        out = tmp_path / f"{variant}.yaml"
        promote(spec, variant, out)
        diff = [line for line in difflib.unified_diff(before, out.read_text().splitlines(), lineterm="", n=0)
                if line[:1] in "+-" and not line.startswith(("+++", "---"))]
        assert sorted(diff) == sorted(expected), diff


@pytest.mark.slow  # the session's Prefect server
def test_status_shows_each_runs_verdict_with_its_numbers(prefect_server: str, tmp_path: Path):
    """A run's success report publishes its criteria as a table (tasks/kinds/success_report.py; a reused report
    publishes them again: flows/lifecycle.CACHED_TABLES); `compass status` reads the verdict from it, beside the
    state that said only "Completed"."""
    from types import SimpleNamespace

    from prefect import flow
    from prefect.artifacts import create_table_artifact
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from compass.flows.lifecycle import _cached_tables
    from compass.flows.reports.recent_runs import LIFECYCLE_FLOW
    from tests.conftest import base_env

    criteria = [{"criterion": "arc_easy:cf/acc >= 0.3", "checkpoint": "evaluate:post_train-sft", "measured": 0.4166,
                 "interval": [0.3012, 0.5321], "verdict": "pass", "note": ""},
                {"criterion": "val_ppl:notes <= 100.0", "checkpoint": "evaluate:post_train-sft",
                 "measured": 316.94117, "interval": None, "verdict": "fail", "note": ""}]
    reused = SimpleNamespace(metrics={"passed": False, "criteria": criteria})
    assert _cached_tables(SimpleNamespace(kind="report"), reused) == {"success": criteria}
    assert _cached_tables(SimpleNamespace(kind="evaluate"), reused) == {}

    @flow(name=LIFECYCLE_FLOW, flow_run_name="verdict-probe")
    def verdict_probe() -> None:
        create_table_artifact(key="verdict-probe-success-success", table=criteria)

    with temporary_settings({PREFECT_API_URL: prefect_server}):
        verdict_probe()
    env = base_env(tmp_path / "client") | {"PREFECT_API_URL": prefect_server}

    def status(*args: str) -> str:
        done = subprocess.run([sys.executable, "-m", "compass.flows.cli.app", "status", *args], cwd=tmp_path,
                              capture_output=True, text=True, timeout=300, env=env)
        assert done.returncode == 0, done.stderr[-3000:]
        return done.stdout

    (row,) = [r for r in json.loads(status("--json")) if r["name"] == "verdict-probe"]
    assert row["verdict"]["passed"] is False and len(row["verdict"]["criteria"]) == 2
    assert "NOT MET: 1 of 2 pass" in status()
    # the terminal's criterion lines carry the interval and round to four figures
    from compass.flows.reports.run_outcome import Criterion

    assert [Criterion.model_validate(c).line() for c in criteria] == [
        "arc_easy:cf/acc >= 0.3 at evaluate:post_train-sft: 0.4166 (95% interval 0.3012 to 0.5321), pass",
        "val_ppl:notes <= 100.0 at evaluate:post_train-sft: 316.9, fail"]


def test_the_run_summary_ends_with_each_ablations_verdict_and_interval(tmp_path: Path):
    """`compass run` ended with the success criteria but not the ablations' verdicts: each variant's difference,
    its 95% interval paired by seed and its verdict now follow them, from the committed comparison."""
    from compass.flows.reports.run_outcome import outcome_lines, run_outcome
    from compass.flows.reports.step_record import StepRecord
    from compass.infra.layout import COMPARISON
    from compass.infra.store import Store
    from compass.tasks.common.comparison import ComparedVariant, Comparison
    from tests.test_store import manifest_for

    store = Store(str(tmp_path / "store"))
    comparison = Comparison(metric="val_loss", rows=[
        ComparedVariant(variant="baseline", verdict="reference", delta=0.0),
        ComparedVariant(variant="untied", verdict="better", delta=-0.02134, interval=[-0.0311, -0.0116]),
        ComparedVariant(variant="more_code", verdict="within noise", delta=0.004, interval=[-0.01, 0.018])])
    with store.staging() as out:
        (out / COMPARISON).write_text(comparison.json_text())
        manifest = store.commit(out, manifest_for(store, "compare", "ablations", "c" * 64))
    record = StepRecord(step="compare:ablations", uri=manifest.uri, executed=True, seconds=1.0, pid=1)
    lines = outcome_lines(run_outcome([record], store))
    at = lines.index("ablations against the baseline (val_loss, paired by seed):")
    assert lines[at + 1:at + 3] == ["  untied: val_loss -0.0213 (95% interval -0.0311 to -0.0116), better",
                                    "  more_code: val_loss +0.004 (95% interval -0.01 to 0.018), within noise"]


def test_a_long_loss_series_is_drawn_faint_with_its_moving_average_over_it():
    """A per-step loss is mostly noise: from 30 points on, a stage's raw loss is faint and its debiased moving
    average drawn over it; a short stage keeps its marked points."""
    from compass.model.training.records import MetricsRow
    from compass.tasks.common.plots import PlotDescription
    from compass.tasks.common.training import loss_png, smoothed

    rows = [MetricsRow(step=i, stage="stage1", stage_step=i, loss=3.0 - i / 100 + (0.3 if i % 2 else -0.3),
                       tokens=100 * i) for i in range(1, 61)]
    rows += [MetricsRow(step=60 + i, stage="sft", stage_step=i, loss=1.0, tokens=6000 + 10 * i) for i in range(1, 5)]
    (panel,) = PlotDescription.read(loss_png(rows, "t")).panels
    series = {s.label: list(s.y) for s in panel.series}
    assert list(series) == ["stage1", "stage1 (smoothed)", "sft"]
    assert series["stage1 (smoothed)"] == pytest.approx(smoothed(series["stage1"]))
    assert smoothed([2.0, 2.0, 2.0]) == pytest.approx([2.0, 2.0, 2.0])  # debiased: no ramp up from zero
    swing = max(series["stage1"][30:]) - min(series["stage1"][30:])
    assert max(series["stage1 (smoothed)"][30:]) - min(series["stage1 (smoothed)"][30:]) < swing / 2


def test_the_curves_join_the_model_across_stages_and_draw_its_criteria(tmp_path: Path):
    from compass.tasks.common.plots import PlotDescription
    from compass.tasks.kinds.curves import plot_curves

    points = {"val_ppl:notes": {"pretrain:stage1": [(1000, 900.0), (2000, 500.0)], "pretrain:stage2": [(3000, 300.0)],
                                "post_train:sft": [(3000, 320.0)]}}
    plot_curves(points, tmp_path / "curves.png", "t", {"val_ppl:notes": ["<= 1000"]})
    (panel,) = PlotDescription.read(tmp_path / "curves.png").panels
    series = {s.label: list(zip(s.x, s.y, strict=True)) for s in panel.series}
    # pretraining's stages continue one model: one line through them; a post-training variant stays a point
    assert series["the model across its stages"] == [(1000, 900.0), (2000, 500.0), (3000, 300.0)]
    assert panel.thresholds == {"criterion <= 1000": 1000.0} and "criterion <= 1000" in panel.texts
    assert panel.ylabel == "perplexity (log scale, lower is better)" and panel.outside == []
    # a few plain numbers on the log axis, not a label at every minor tick in scientific notation (3x10^2, 4x10^2..)
    assert 3 <= len(panel.yticks) <= 5 and all(re.fullmatch(r"[\d,.]+", t) for t in panel.yticks), panel.yticks
    values = [float(t.replace(",", "")) for t in panel.yticks]
    assert values == sorted(values) and panel.ylim[0] < values[0] and values[-1] < panel.ylim[1]


def test_the_ablation_plot_draws_differences_from_zero_with_verdicts_and_intervals(tmp_path: Path):
    """Raw means on an axis cut just below them made a 0.2% difference look like a factor of two."""
    from compass.tasks.common.plots import PlotDescription
    from compass.tasks.kinds.ablate import _plot

    rows = [{"variant": "baseline", "val_loss": 4.5123, "delta": 0.0, "delta 95% interval": None,
             "verdict": "reference"},
            {"variant": "untied", "val_loss": 4.491, "delta": -0.0213, "delta 95% interval": [-0.0311, -0.0116],
             "verdict": "better"},
            {"variant": "more_code", "val_loss": 4.516, "delta": 0.004, "delta 95% interval": [-0.01, 0.018],
             "verdict": "within noise"}]
    _plot(rows, "val_loss", tmp_path / "comparison.png")
    (panel,) = PlotDescription.read(tmp_path / "comparison.png").panels
    assert panel.bars == {"untied": -0.0213, "more_code": 0.004} and panel.ylim[0] < -0.0311 and panel.ylim[1] > 0.018
    assert panel.texts == ("better\n-0.0213 [-0.0311, -0.0116]", "within noise\n+0.004 [-0.01, +0.018]")
    assert "minus the baseline's" in panel.ylabel and "4.512" in panel.title
