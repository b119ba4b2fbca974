"""Curation counts what it reads and writes in the datatrove passes that read the data anyway (a measuring block
after the first reader, the train/held-out router per split), not in two more Python passes over every document
on the step's machine: the counts equal the documents, words and bytes of the files themselves. Its last removal
(the filters, or a dedup's) runs in the split's pass, with the documents datatrove's passes one by one give."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

from tests.conftest import REPO
from tests.shards import SHARD_SUFFIX, shard_lines, shard_records

WORD = re.compile(r"\w+", re.UNICODE)


def _files_count(folder: Path) -> dict[str, int]:
    docs = words = size = 0
    for shard in sorted(folder.glob("*" + SHARD_SUFFIX)):
        for record in shard_records(shard):
            text = record["text"]
            docs, words, size = docs + 1, words + len(WORD.findall(text)), size + len(text.encode())
    return {"documents": docs, "words": words, "bytes": size}


def _lines(shard: Path) -> int:
    return len(shard_lines(shard))


def test_curation_counts_in_its_datatrove_passes_what_the_files_hold(tmp_path: Path):
    from compass.flows.compiler import compile_spec
    from compass.flows.runner import run_in_process
    from compass.infra.layout import CuratedArtifact
    from compass.infra.store import Store
    from compass.specs import load_spec
    from compass.tasks.steps.context import Runtime

    loaded = load_spec(REPO / "tests" / "specs" / "minimal.yaml")
    plan = compile_spec(loaded.spec)
    store = Store(str(tmp_path / "store"))
    run_in_process(plan.restricted_to({"ingest", "curate"}), store, loaded.spec_hash,
                   Runtime(how=loaded.spec.how, base_dir=loaded.base_dir), logging.getLogger("test"))
    checked = 0
    for step in plan.steps:
        if step.kind != "curate":
            continue
        uri = store.uri("curate", step.name, plan.fingerprints[step.id])
        raw_uri = store.uri("ingest", step.name, plan.fingerprints[f"ingest:{step.name}"])
        curated = CuratedArtifact(store.local_path(uri))
        stats = json.loads(curated.stats.read_text())
        assert stats["before"] == _files_count(store.local_path(raw_uri) / "documents")
        first = {b["name"]: b["stats"] for b in stats["stages"][0]["blocks"]}  # counted in the first pass itself
        assert {k: first["📊 - STATS: 📏 measure"][k] for k in ("documents", "words", "bytes")} == stats["before"]
        routed = {b["name"]: b["stats"] for b in stats["stages"][-1]["blocks"]}["🔢 - SPLIT: ✂️ train/heldout"]
        assert routed["train_words"] == stats["splits"]["train"]["words"]
        for split, counted in stats["splits"].items():
            assert counted == _files_count(curated.split(split)), split
        on_disk = {f"{split}/{shard.name}": _lines(shard) for split in stats["splits"]
                   for shard in sorted(curated.split(split).glob("*" + SHARD_SUFFIX))}
        assert stats["per_shard"] == on_disk  # each shard's documents, from the ranks' own counts
        raw = json.loads((store.local_path(raw_uri) / "stats.json").read_text())["per_shard"]
        ingested = sorted((store.local_path(raw_uri) / "documents").glob("*" + SHARD_SUFFIX))
        assert {name: c["documents"] for name, c in raw.items()} == {shard.name: _lines(shard) for shard in ingested}
        metrics = store.read_manifest(uri).metrics
        assert metrics["words_in"] == stats["before"]["words"] > 0
        assert metrics["train_documents"] == stats["splits"]["train"]["documents"] > 0
        if step.config.curation.minhash:
            # the dedups' removals ride along in the later passes (the exact one in MinHash's signature pass and
            # the split's, MinHash's in the split's): two writes and reads of the corpus fewer, and the same
            # documents as datatrove's passes each written out
            assert [s["stage"] for s in stats["stages"]] == ["filter", "exact-signature", "exact-find",
                                                             "minhash-signature", "minhash-buckets",
                                                             "minhash-cluster", "split"]
            assert stats["removed_by"]["exact_dedup"] and stats["removed_by"]["minhash_dedup"]  # both remove
            one_by_one = _curated_pass_by_pass(store.local_path(raw_uri) / "documents", step.config,
                                               tmp_path / "pass-by-pass")
            for split in stats["splits"]:
                assert _records(curated.split(split)) == _records(one_by_one / split), split
        checked += 1
    assert checked == 2  # both sources of the minimal spec, one with filters and dedup, one without


def _records(folder: Path) -> list[dict]:
    return [record for shard in sorted(folder.glob("*" + SHARD_SUFFIX)) for record in shard_records(shard)]


def _curated_pass_by_pass(documents: Path, config, work: Path) -> Path:
    """The curation of `config` (filters, exact dedup, MinHash) as datatrove passes that each write their output (what
    compass ran before the dedups' removals moved into the later passes)."""
    from datatrove.executor import LocalPipelineExecutor
    from datatrove.pipeline import dedup
    from datatrove.pipeline.readers import JsonlReader

    from compass.tasks.data.curate_blocks import (
        FILTERS,
        LanguageIdFilter,
        ShardWriter,
        SplitTagger,
        document_text,
        portable_record,
    )

    cur, shards = config.curation, len(list(documents.glob("*" + SHARD_SUFFIX)))
    mh = dedup.MinhashConfig(n_grams=cur.minhash.n_grams, num_buckets=cur.minhash.num_buckets,
                             hashes_per_bucket=cur.minhash.hashes_per_bucket)

    def run(name: str, pipeline: list, tasks: int = shards) -> None:
        LocalPipelineExecutor(pipeline, tasks=tasks, workers=1, logging_dir=str(work / "logs" / name)).run()

    filters = [FILTERS[f.name](**f.params) for f in cur.filters]
    filters.append(LanguageIdFilter(cur.language_id.keep, cur.language_id.min_score, config.language))
    run("filter", [JsonlReader(str(documents)), *filters, ShardWriter(str(work / "filtered"))])
    exact = dedup.ExactDedupConfig(content_getter=document_text)
    assert cur.exact_dedup
    run("exact-signature", [JsonlReader(str(work / "filtered")), dedup.ExactDedupSignature(str(work / "es"), exact)])
    run("exact-find", [dedup.ExactFindDedups(str(work / "es"), str(work / "ed"), exact)], 1)
    run("exact-filter", [JsonlReader(str(work / "filtered")), dedup.ExactDedupFilter(str(work / "ed"), exact),
                         ShardWriter(str(work / "exact"))])
    run("signature", [JsonlReader(str(work / "exact")), dedup.MinhashDedupSignature(str(work / "sigs"), mh)])
    run("buckets", [dedup.MinhashDedupBuckets(str(work / "sigs"), str(work / "buckets"), config=mh)], mh.num_buckets)
    run("cluster", [dedup.MinhashDedupCluster(str(work / "buckets"), str(work / "remove"), config=mh)], 1)
    run("remove", [JsonlReader(str(work / "exact")), dedup.MinhashDedupFilter(str(work / "remove")),
                   ShardWriter(str(work / "deduplicated"))])
    run("split", [JsonlReader(str(work / "deduplicated")),
                  SplitTagger(cur.heldout_fraction, config.heldout_unit or "document"),
                  ShardWriter(str(work / "split"), output_filename="${split}/${rank}" + SHARD_SUFFIX,
                              adapter=portable_record)])
    return work / "split"


def test_each_dedup_removes_the_documents_it_found_though_its_removal_runs_in_later_passes(tmp_path: Path):
    """The exact removal runs inside MinHash's signature pass and the split's, MinHash's inside the split's: each
    finds documents by their index in the stream it saw, so the signature pass must see the exact removal too. An
    exact copy before a near copy in the same file tells: indexing the unremoved stream would drop the wrong one."""
    import random

    from compass.flows.compiler import compile_spec
    from compass.flows.runner import run_in_process
    from compass.infra.layout import CuratedArtifact
    from compass.infra.store import Store
    from compass.specs import load_spec
    from compass.specs.data import MinhashSpec
    from compass.tasks.steps.context import Runtime

    rng = random.Random(0)
    vocabulary = ["".join(rng.choices("abcdefghijklmnopqrstuvwxyz", k=6)) for _ in range(5000)]  # MinHash drops digits
    texts = {name: " ".join(rng.choices(vocabulary, k=80)) for name in ("a", "b", "c", "d")}
    near_b = texts["b"].rsplit(" ", 1)[0] + " ending"  # one word of 80 changed: MinHash's, not exact's
    order = [("a", texts["a"]), ("a-copy", texts["a"]), ("b", texts["b"]), ("b-near", near_b), ("c", texts["c"]),
             ("d", texts["d"])]
    (tmp_path / "web").mkdir()
    (tmp_path / "web" / "00000.jsonl").write_text("".join(json.dumps({"id": i, "text": t}) + "\n" for i, t in order))
    loaded = load_spec(REPO / "tests" / "specs" / "minimal.yaml")
    spec = loaded.spec
    sources = [s.model_copy(update={"uri": str(tmp_path / "web"), "include": ["*.jsonl"], "format": "jsonl",
                                    "curation": s.curation.model_copy(update={
                                        "filters": [], "language_id": None, "exact_dedup": True,
                                        "minhash": MinhashSpec(n_grams=5, num_buckets=8, hashes_per_bucket=8),
                                        "heldout_fraction": 0.0})}) if s.name == "notes" else s
               for s in spec.what.data.sources]
    spec = spec.model_copy(update={"what": spec.what.model_copy(update={"data": spec.what.data.model_copy(
        update={"sources": sources})})})
    plan = compile_spec(spec)
    store = Store(str(tmp_path / "store"))
    run_in_process(plan.up_to(["curate:notes"]), store, loaded.spec_hash,
                   Runtime(how=spec.how, base_dir=loaded.base_dir), logging.getLogger("test"))
    curated = CuratedArtifact(store.local_path(store.uri("curate", "notes", plan.fingerprints["curate:notes"])))
    stats = json.loads(curated.stats.read_text())
    assert [s["stage"] for s in stats["stages"]] == ["exact-signature", "exact-find", "minhash-signature",
                                                     "minhash-buckets", "minhash-cluster", "split"]
    kept = [r["text"] for r in _records(curated.split("train"))]  # one of b's pair: MinHash's cluster picks which
    assert kept in ([texts["a"], texts["b"], texts["c"], texts["d"]], [texts["a"], near_b, texts["c"], texts["d"]])
    assert stats["removed_by"] == {"exact_dedup": 1, "minhash_dedup": 1}
