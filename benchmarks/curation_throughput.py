"""Curation throughput: compass's curate step against the same datatrove blocks run by hand.

Both variants read the same ingested documents (real text: the Shakespeare source of the demo spec) and
run filters -> language id -> exact dedup -> MinHash dedup -> write. Each runs in its own process so its
peak memory (max RSS of the process and its datatrove workers) is measured separately.

    python benchmarks/curation_throughput.py [--spec specs/examples/tiny.yaml] [--source books_en] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

from harness import child, interleave, pin_threads, report, write_result

REPO = Path(__file__).resolve().parent.parent

CURATION = {"filters": [{"name": "gopher_repetition", "params": {}},
                        {"name": "gopher_quality", "params": {"min_doc_words": 30}}],
            "language_id": {"keep": ["en"], "min_score": 0.5}, "exact_dedup": True,
            "minhash": {"n_grams": 5, "num_buckets": 14, "hashes_per_bucket": 8}, "heldout_fraction": 0.05}


def ingest(spec: Path, source: str, store: Path) -> Path:
    """Ingest one source of a spec once (cached in the store) and return its documents folder."""
    import logging

    from compass.flows.compiler import compile_spec
    from compass.flows.runner import RunContext, run_step
    from compass.infra.store import Store
    from compass.specs import load_spec
    from compass.tasks.steps.context import Runtime

    loaded = load_spec(spec)
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

    from compass.infra.layout import SHARD_SUFFIX
    from compass.tasks.data.curate_blocks import LanguageIdFilter, SplitTagger, document_text
    from compass.tasks.data.shard_codec import SHARD_CODEC

    n = len(list(docs.glob("*" + SHARD_SUFFIX)))
    codec = SHARD_CODEC  # compass's shards' zstd (level 3): fsspec's own "zstd" writes at level 10, costing more
    gz = "${rank}" + SHARD_SUFFIX  # named by hand: datatrove names only its own codecs, and readers infer from it
    logs, work = out / "logs", out / "work"
    exact = ExactDedupConfig(content_getter=document_text)
    mh = MinhashConfig(n_grams=5, num_buckets=14, hashes_per_bucket=8)

    def go(pipeline, tasks, name):
        LocalPipelineExecutor(pipeline, tasks=tasks, workers=min(tasks, workers), logging_dir=str(logs / name),
                              skip_completed=False).run()

    go([JsonlReader(str(docs)), GopherRepetitionFilter(), GopherQualityFilter(min_doc_words=30),
        LanguageIdFilter(["en"], 0.5), JsonlWriter(str(work / "filtered"), output_filename=gz, compression=codec)],
       n, "filter")
    go([JsonlReader(str(work / "filtered")), ExactDedupSignature(str(work / "es"), exact)], n, "es")
    go([ExactFindDedups(str(work / "es"), str(work / "ed"), exact)], 1, "ef")
    go([JsonlReader(str(work / "filtered")), ExactDedupFilter(str(work / "ed"), exact),
        JsonlWriter(str(work / "exact"), output_filename=gz, compression=codec)], n, "ex")
    go([JsonlReader(str(work / "exact")), MinhashDedupSignature(str(work / "ms"), mh)], n, "ms")
    go([MinhashDedupBuckets(str(work / "ms"), str(work / "mb"), config=mh)], mh.num_buckets, "mb")
    go([MinhashDedupCluster(str(work / "mb"), str(work / "mr"), config=mh)], 1, "mc")
    go([JsonlReader(str(work / "exact")), MinhashDedupFilter(str(work / "mr")), SplitTagger(0.05),
        JsonlWriter(str(out / "curated"), output_filename="${split}/${rank}" + SHARD_SUFFIX,
                   compression=codec)], n, "mf")


def run_through_compass(docs: Path, out: Path, workers: int) -> None:
    """compass's curate executor with its store commit (checksums, manifest), without Prefect."""
    import logging

    from compass.flows.compiler import Plan
    from compass.flows.runner import RunContext, run_step
    from compass.infra.fingerprint import fingerprint, sha256_file
    from compass.infra.layout import SHARD_SUFFIX
    from compass.infra.manifest import FileEntry, Manifest
    from compass.infra.store import Store
    from compass.specs.data import Curation
    from compass.specs.how import How, Orchestration
    from compass.tasks.kinds.curate import CurateConfig
    from compass.tasks.steps.context import Runtime
    from compass.tasks.steps.kind import Step
    from compass.tasks.steps.step_config import EmptyConfig

    store = Store(str(out / "store"))
    raw = Step("ingest", "bench", EmptyConfig())
    config = CurateConfig(curation=Curation.model_validate(CURATION), language="en", domain="books")
    cur = Step("curate", "bench", config, {"raw": raw.id})
    fps = {raw.id: fingerprint("ingest", {"path": str(docs)}, {}, "bench")}
    fps[cur.id] = fingerprint("curate", cur.config.identity(), {"raw": fps[raw.id]}, "bench")
    plan = Plan("bench", [raw, cur], fps)
    raw_uri = store.uri("ingest", "bench", fps[raw.id])
    # its shards listed as a commit lists them: the step sizes its stages (tasks, executor) from that list
    files = [FileEntry(path=f"documents/{shard.name}", size=shard.stat().st_size, sha256=sha256_file(str(shard)))
             for shard in sorted(docs.glob("*" + SHARD_SUFFIX))]
    with store.staging() as staged:  # register the ingested documents as a committed input artifact
        (staged / "documents").mkdir()  # hard links: an artifact holds files, never a link out of the store
        for shard in sorted(docs.glob("*" + SHARD_SUFFIX)):
            os.link(shard, staged / "documents" / shard.name)
        store._move_into_place(staged, Path(raw_uri), Manifest(
            kind="ingest", name="bench", fingerprint=fps[raw.id], uri=raw_uri, config={}, spec_hash="-",
            spec_name="bench", code_version="-", phase_version="-", libraries={}, host="-", python="-",
            started_at=0, finished_at=0, files=files).model_dump_json())
    ctx = RunContext(plan, store, "bench", Runtime(how=How(orchestration=Orchestration(workers=workers))))
    run_step(ctx, cur, logging.getLogger("bench"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spec", default=str(REPO / "specs" / "examples" / "tiny.yaml"))
    parser.add_argument("--source", default="books_en")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--store", default=str(REPO / "store"))
    parser.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        pin_threads()
        variant, docs, workers, out = args.child
        with tempfile.TemporaryDirectory() as folder:
            start = time.perf_counter()
            {"datatrove": run_by_hand, "compass": run_through_compass}[variant](Path(docs), Path(folder),
                                                                              int(workers))
            write_result(out, time.perf_counter() - start)  # peak: max RSS of the process and its workers
        return
    from compass.infra.environment import prepare_environment

    prepare_environment()
    docs = ingest(Path(args.spec), args.source, Path(args.store))
    n_docs = n_bytes = 0
    from compass.infra.layout import SHARD_SUFFIX
    from compass.tasks.data.shard_codec import open_shard

    for shard in docs.glob("*" + SHARD_SUFFIX):
        with open(shard, "rb") as raw, open_shard(raw) as f:
            for line in f:
                n_docs += 1
                n_bytes += len(json.loads(line)["text"].encode())
    results = interleave({v: (lambda v=v: child(__file__, [v, str(docs), str(args.workers)]))
                          for v in ("datatrove", "compass")}, args.rounds)
    for runs in results.values():  # report documents per second
        for r in runs:
            r.details["seconds"], r.value = r.value, n_docs / r.value
    report(f"curation of {args.source}: {n_docs:,} documents, {n_bytes / 1e6:.1f} MB, workers={args.workers}",
           results, "datatrove", "docs/s")


if __name__ == "__main__":
    main()
