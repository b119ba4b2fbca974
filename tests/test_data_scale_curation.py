"""Curation counts what it reads and writes in the datatrove passes that read the data anyway (a measuring block
after the first reader, the train/held-out router per split), not in two more Python passes over every document
on the step's machine: the counts equal the documents, words and bytes of the files themselves."""

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
        checked += 1
    assert checked == 2  # both sources of the minimal spec, one with filters and dedup, one without
