"""Data throughput: compass's ingest -> curate (no filters: the split) -> tokenize steps against datatrove's own
pipelines on the same JSONL files with the same tokenizer, executor and workers. Documents per second over the
whole path, tokens per second, and how each scales from 1 to 2 workers.

The ratio is against "datatrove": its one-pass pipeline producing the same tokens (JsonlReader -> DocumentTokenizer,
keeping no documents), so it counts everything compass does beyond it: keeping the ingested and curated documents as
artifacts (zstd shards), the store, manifests and hashes, verified reads, the steps' glue. A second row,
"datatrove stages", runs the same three passes as compass as datatrove pipelines written by hand (JsonlReader ->
ShardWriter; JsonlReader -> train/held-out split -> ShardWriter; JsonlReader -> DocumentTokenizer per split).

All read the same generated source (`--files` JSONL files of `--documents` documents); compass's steps run as a
run would (store, manifests, verification), each round in a fresh store with the tokenizer already chosen.

    python benchmarks/data_throughput.py [--files 8] [--documents 2000] [--rounds 3] [--variants NAME ...]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import random
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from harness import child, interleave, note, report, write_result

REPO = Path(__file__).resolve().parent.parent
SOURCE = "notes"
ENGINES = ("datatrove stages", "compass", "datatrove")
VARIANTS = {f"{engine}, {n} worker{'s' * (n > 1)}": (engine, n) for n in (1, 2) for engine in ENGINES}


def generate(folder: Path, files: int, documents: int) -> int:
    """JSONL files of documents drawn from the README's words (a real word distribution); returns documents."""
    words = (REPO / "README.md").read_text().split()
    rng = random.Random(0)
    folder.mkdir(parents=True)
    for i in range(files):
        with open(folder / f"{i:05d}.jsonl", "w") as f:
            for j in range(documents):
                text = " ".join(rng.choice(words) for _ in range(rng.randint(100, 600)))
                f.write(json.dumps({"id": f"{i}-{j}", "text": text}) + "\n")
    return files * documents


def plan_for(source: Path, workers: int):
    """(loaded spec, plan) of the minimal spec with its `notes` source read from `source`, curated by the split
    alone (no filters, no dedup), and `workers` datatrove workers."""
    from compass.flows.compiler import compile_spec
    from compass.specs import load_spec

    loaded = load_spec(REPO / "tests" / "specs" / "minimal.yaml")
    spec = loaded.spec
    sources = [s.model_copy(update={"uri": str(source), "include": ["*.jsonl"], "format": "jsonl",
                                    "curation": s.curation.model_copy(update={
                                        "filters": [], "language_id": None, "minhash": None, "exact_dedup": False,
                                        "heldout_fraction": 0.05})}) if s.name == SOURCE else s
               for s in spec.what.data.sources]
    # the same executor as the baselines: a pool of `workers` even for small inputs
    orchestration = spec.how.orchestration.model_copy(update={"workers": workers, "in_process_below_mib": 0})
    spec = spec.model_copy(update={"what": spec.what.model_copy(update={"data": spec.what.data.model_copy(
        update={"sources": sources})}), "how": spec.how.model_copy(update={"orchestration": orchestration})})
    return dataclasses.replace(loaded, spec=spec), compile_spec(spec)


def prepare(work: Path, files: int, documents: int) -> dict:
    """The source, and a store holding the chosen tokenizer (the steps before tokenization, run once)."""
    from compass.flows.runner import run_in_process
    from compass.infra.layout import TokenizerArtifact
    from compass.infra.store import Store
    from compass.tasks.steps.context import Runtime

    n = generate(work / "source", files, documents)
    loaded, plan = plan_for(work / "source", 2)
    store = Store(str(work / "prepared"))
    run_in_process(plan.restricted_to({"ingest", "curate", "tokenizer"}), store, loaded.spec_hash,
                   Runtime(how=loaded.spec.how, base_dir=loaded.base_dir), logging.getLogger("bench"))
    step = next(s for s in plan.steps if s.kind == "tokenizer")
    uri = store.uri(step.kind, step.name, plan.fingerprints[step.id])
    return {"work": str(work), "documents": n, "tokenizer_uri": uri,
            "tokenizer": str(TokenizerArtifact(store.local_path(uri)).chosen / "tokenizer.json")}


def run_compass(ctx: dict, workers: int, out: Path) -> tuple[float, int]:
    """Seconds of ingest + curate + tokenize of the source in a fresh store; the tokens written."""
    from compass.flows.runner import RunContext, run_step
    from compass.infra.store import Store
    from compass.tasks.steps.context import Runtime

    loaded, plan = plan_for(Path(ctx["work"]) / "source", workers)
    prepared = Path(ctx["tokenizer_uri"])
    shutil.copytree(prepared, out / "store" / prepared.relative_to(Path(ctx["work"]) / "prepared"))
    run = RunContext(plan, Store(str(out / "store")), loaded.spec_hash,
                     Runtime(how=loaded.spec.how, base_dir=loaded.base_dir))
    log = logging.getLogger("bench")
    start = time.perf_counter()
    for step_id in (f"ingest:{SOURCE}", f"curate:{SOURCE}", f"tokenize:{SOURCE}"):
        outcome = run_step(run, plan.step(step_id), log)
    seconds = time.perf_counter() - start
    metrics = outcome.manifest.metrics
    return seconds, metrics["train_tokens"] + metrics["heldout_tokens"]


def run_datatrove(ctx: dict, workers: int, out: Path) -> tuple[float, int]:
    """Seconds of datatrove's JsonlReader -> DocumentTokenizer over the same files; the tokens written."""
    from datatrove.executor import LocalPipelineExecutor
    from datatrove.pipeline.readers import JsonlReader
    from datatrove.pipeline.tokens import DocumentTokenizer

    files = len(list((Path(ctx["work"]) / "source").glob("*.jsonl")))
    start = time.perf_counter()
    LocalPipelineExecutor([JsonlReader(str(Path(ctx["work"]) / "source")),
                           DocumentTokenizer(str(out / "tokens"), tokenizer_name_or_path=ctx["tokenizer"],
                                             eos_token="<|endoftext|>", shuffle_documents=False)],
                          tasks=files, workers=workers, logging_dir=str(out / "logs")).run()
    seconds = time.perf_counter() - start
    stats = json.loads((out / "logs" / "stats.json").read_text())
    tokens = next(b["stats"]["tokens"]["total"] for b in stats if "tokens" in b.get("stats", {}))
    return seconds, tokens


def run_datatrove_stages(ctx: dict, workers: int, out: Path) -> tuple[float, int]:
    """Seconds of the same three passes as compass's steps, as datatrove pipelines run by hand; the tokens."""
    from datatrove.executor import LocalPipelineExecutor
    from datatrove.pipeline.readers import JsonlReader
    from datatrove.pipeline.tokens import DocumentTokenizer

    # datatrove's JsonlWriter with zstd at level 3, as compass writes (ShardWriter is exactly that)
    from compass.infra.layout import SHARD_SUFFIX
    from compass.tasks.data.curate_blocks import ShardWriter, SplitTagger

    files = len(list((Path(ctx["work"]) / "source").glob("*.jsonl")))
    start = time.perf_counter()
    LocalPipelineExecutor([JsonlReader(str(Path(ctx["work"]) / "source")),
                           ShardWriter(str(out / "ingested"))],
                          tasks=files, workers=workers, logging_dir=str(out / "logs-ingest")).run()
    LocalPipelineExecutor([JsonlReader(str(out / "ingested")), SplitTagger(0.05),
                           ShardWriter(str(out / "split"), output_filename="${split}/${rank}" + SHARD_SUFFIX)],
                          tasks=files, workers=workers, logging_dir=str(out / "logs-split")).run()
    tokens = 0
    for split in ("train", "heldout"):
        LocalPipelineExecutor([JsonlReader(str(out / "split" / split)),
                               DocumentTokenizer(str(out / "tokens" / split), tokenizer_name_or_path=ctx["tokenizer"],
                                                 eos_token="<|endoftext|>", shuffle_documents=False)],
                              tasks=files, workers=workers, logging_dir=str(out / f"logs-{split}")).run()
        stats = json.loads((out / f"logs-{split}" / "stats.json").read_text())
        tokens += next(b["stats"]["tokens"]["total"] for b in stats if "tokens" in b.get("stats", {}))
    return time.perf_counter() - start, tokens


RUNNERS = {"compass": run_compass, "datatrove": run_datatrove, "datatrove stages": run_datatrove_stages}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", type=int, default=8)
    parser.add_argument("--documents", type=int, default=2000, help="per file")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), help="a subset of: "
                        + "; ".join(VARIANTS))
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        name, ctx_path, result = args.child
        ctx = json.loads(Path(ctx_path).read_text())
        engine, workers = VARIANTS[name]
        with tempfile.TemporaryDirectory(prefix="compass-data-", dir=ctx["work"]) as out:
            seconds, tokens = RUNNERS[engine](ctx, workers, Path(out))
        write_result(result, ctx["documents"] / seconds, tokens_per_s=tokens / seconds)
        return
    work = Path(tempfile.mkdtemp(prefix="compass-data-throughput-"))
    try:
        ctx = prepare(work, args.files, args.documents)
        (work / "ctx.json").write_text(json.dumps(ctx))
        chosen = args.variants
        unknown = sorted(set(chosen) - set(VARIANTS))
        if unknown:
            parser.error(f"unknown variants {unknown}: choose from {'; '.join(VARIANTS)}")
        results = interleave({name: (lambda name=name: child(__file__, [name, str(work / "ctx.json")], cwd=REPO))
                              for name in chosen}, args.rounds)
        title = f"data: {ctx['documents']:,} documents in {args.files} JSONL files, ingest..tokenize"
        for workers in (1, 2):
            pair = {name: runs for name, runs in results.items() if VARIANTS[name][1] == workers}
            baseline = f"datatrove, {workers} worker{'s' * (workers > 1)}"  # the same tokens, in one pass
            if baseline in pair:
                report(f"{title}, {workers} worker(s)", pair, baseline, "docs/s")
        for engine in ENGINES:
            speeds = [statistics.median([r.details["tokens_per_s"] for r in results[name]])
                      for name, (e, _) in VARIANTS.items() if e == engine and name in results]
            if len(speeds) == 2:
                note(f"{engine}: {speeds[0]:,.0f} -> {speeds[1]:,.0f} tokens/s from 1 to 2 workers "
                     f"({speeds[1] / speeds[0]:.2f}x)")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
