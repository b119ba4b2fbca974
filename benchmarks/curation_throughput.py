"""Curation throughput: compass's curate step against the same datatrove blocks run by hand.

Both variants read the same ingested documents (real text: the Shakespeare source of the demo spec) and
run filters -> language id -> exact dedup -> MinHash dedup -> write. Each runs in its own process so its
peak memory (max RSS of the process and its datatrove workers) is measured separately.

    python benchmarks/curation_throughput.py [--source books_en] [--repeat 2]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

CURATION = {"filters": [{"name": "gopher_repetition", "params": {}},
                        {"name": "gopher_quality", "params": {"min_doc_words": 30}}],
            "language_id": {"keep": ["en"], "min_score": 0.5}, "exact_dedup": True,
            "minhash": {"n_grams": 5, "num_buckets": 14, "hashes_per_bucket": 8}, "heldout_fraction": 0.05}


def ingest(source: str, store: Path) -> Path:
    """Ingest the demo source once (cached in the store) and return its documents folder."""
    import logging

    from compass.flows.compiler import compile_spec
    from compass.flows.runner import RunContext, run_step
    from compass.infra.store import Store
    from compass.specs import load_spec
    from compass.tasks.base import Runtime

    loaded = load_spec(REPO / "specs" / "examples" / "tiny.yaml")
    plan = compile_spec(loaded.spec).restricted_to({"ingest"})
    ctx = RunContext(plan, Store(str(store)), loaded.spec_hash, Runtime(how=loaded.spec.how, base_dir=loaded.base_dir))
    outcome = run_step(ctx, plan.step(f"ingest:{source}"), logging.getLogger("bench"))
    return Path(outcome.uri) / "documents"


def run_by_hand(docs: Path, out: Path, workers: int) -> None:
    """What a datatrove user writes without compass: the same blocks, the same stages."""
    from datatrove.executor import LocalPipelineExecutor
    from datatrove.pipeline.dedup import (
        ExactDedupConfig,
        ExactDedupFilter,
        ExactDedupSignature,
        ExactFindDedups,
        MinhashConfig,
        MinhashDedupBuckets,
        MinhashDedupCluster,
        MinhashDedupFilter,
        MinhashDedupSignature,
    )
    from datatrove.pipeline.filters import GopherQualityFilter, GopherRepetitionFilter
    from datatrove.pipeline.readers import JsonlReader
    from datatrove.pipeline.writers import JsonlWriter

    from compass.tasks.curate_blocks import LanguageIdFilter, SplitTagger, document_text

    n = len(list(docs.glob("*.jsonl.gz")))
    logs, work = out / "logs", out / "work"
    exact = ExactDedupConfig(content_getter=document_text)
    mh = MinhashConfig(n_grams=5, num_buckets=14, hashes_per_bucket=8)

    def go(pipeline, tasks, name):
        LocalPipelineExecutor(pipeline, tasks=tasks, workers=min(tasks, workers), logging_dir=str(logs / name),
                              skip_completed=False).run()

    go([JsonlReader(str(docs)), GopherRepetitionFilter(), GopherQualityFilter(min_doc_words=30),
        LanguageIdFilter(["en"], 0.5), JsonlWriter(str(work / "filtered"))], n, "filter")
    go([JsonlReader(str(work / "filtered")), ExactDedupSignature(str(work / "es"), exact)], n, "es")
    go([ExactFindDedups(str(work / "es"), str(work / "ed"), exact)], 1, "ef")
    go([JsonlReader(str(work / "filtered")), ExactDedupFilter(str(work / "ed"), exact),
        JsonlWriter(str(work / "exact"))], n, "ex")
    go([JsonlReader(str(work / "exact")), MinhashDedupSignature(str(work / "ms"), mh)], n, "ms")
    go([MinhashDedupBuckets(str(work / "ms"), str(work / "mb"), config=mh)], mh.num_buckets, "mb")
    go([MinhashDedupCluster(str(work / "mb"), str(work / "mr"), config=mh)], 1, "mc")
    go([JsonlReader(str(work / "exact")), MinhashDedupFilter(str(work / "mr")), SplitTagger(0.05),
        JsonlWriter(str(out / "curated"), output_filename="${split}/${rank}.jsonl.gz")], n, "mf")


def run_through_compass(docs: Path, out: Path, workers: int) -> None:
    """compass's curate executor with its store commit (checksums, manifest), without Prefect."""
    import logging

    from compass.flows.compiler import Plan
    from compass.flows.runner import RunContext, run_step
    from compass.infra.fingerprint import fingerprint
    from compass.infra.manifest import Manifest
    from compass.infra.store import Store
    from compass.specs.data import Curation
    from compass.specs.how import How, Orchestration
    from compass.tasks.base import Runtime
    from compass.tasks.curate import CurateConfig
    from compass.tasks.steps import EmptyConfig, Step

    store = Store(str(out / "store"))
    raw = Step("ingest", "bench", EmptyConfig())
    config = CurateConfig(curation=Curation.model_validate(CURATION), language="en", domain="books")
    cur = Step("curate", "bench", config, {"raw": raw.id})
    fps = {raw.id: fingerprint("ingest", {"path": str(docs)}, {}, "bench")}
    fps[cur.id] = fingerprint("curate", cur.config.identity(), {"raw": fps[raw.id]}, "bench")
    plan = Plan("bench", [raw, cur], fps)
    raw_uri = store.uri("ingest", "bench", fps[raw.id])
    with store.staging() as staged:  # register the ingested documents as a committed input artifact
        os.symlink(docs, staged / "documents")
        store._move_into_place(staged, Path(raw_uri), Manifest(
            kind="ingest", name="bench", fingerprint=fps[raw.id], uri=raw_uri, config={}, spec_hash="-",
            spec_name="bench", code_version="-", phase_version="-", libraries={}, host="-", python="-",
            started_at=0, finished_at=0).model_dump_json())
    ctx = RunContext(plan, store, "bench", Runtime(how=How(orchestration=Orchestration(workers=workers))))
    run_step(ctx, cur, logging.getLogger("bench"))


def child(variant: str, docs: str, out: str, workers: int) -> None:
    {"datatrove": run_by_hand, "compass": run_through_compass}[variant](Path(docs), Path(out), workers)


def measure(variant: str, docs: Path, workers: int) -> tuple[float, float]:
    with tempfile.TemporaryDirectory() as out:
        start = time.perf_counter()
        proc = subprocess.Popen([sys.executable, __file__, "--child", variant, str(docs), out, str(workers)],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        _, status, usage = os.wait4(proc.pid, 0)
        elapsed = time.perf_counter() - start
        if status != 0:
            raise SystemExit(f"{variant} failed (status {status})")
    return elapsed, usage.ru_maxrss / 1024  # MiB (ru_maxrss is KiB on Linux)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--source", default="books_en")
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--store", default=str(REPO / "store"))
    parser.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child[0], args.child[1], args.child[2], int(args.child[3]))
        return
    from compass.infra.environment import prepare_environment

    prepare_environment()
    docs = ingest(args.source, Path(args.store))
    n_docs = n_bytes = 0
    import gzip

    for shard in docs.glob("*.jsonl.gz"):
        with gzip.open(shard, "rt") as f:
            for line in f:
                n_docs += 1
                n_bytes += len(json.loads(line)["text"].encode())
    results = {}
    for variant in ("datatrove", "compass"):
        runs = [measure(variant, docs, args.workers) for _ in range(args.repeat)]
        best = min(r[0] for r in runs)
        results[variant] = (best, max(r[1] for r in runs))
    base_t, base_m = results["datatrove"]
    print(f"curation of {args.source}: {n_docs:,} documents, {n_bytes / 1e6:.1f} MB, workers={args.workers}, "
          f"best of {args.repeat}")
    for variant, (t, mem) in results.items():
        print(f"  {variant:10s} {n_docs / t:8.1f} docs/s {n_bytes / 1e6 / t:7.2f} MB/s  peak RSS {mem:7.0f} MiB  "
              f"time ratio vs datatrove {t / base_t:.3f}  memory ratio {mem / base_m:.3f}")


if __name__ == "__main__":
    main()
