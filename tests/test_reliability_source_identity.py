"""A local source's files are part of its ingest step's identity (a digest of their paths, sizes and modification
times, read when the spec loads): a file edited, added or removed after an ingest makes the next run ingest again,
while an untouched folder keeps the cached artifact. The digest is compass's to fill in, never the spec's."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

from compass.specs.loader import SpecError, load_spec
from tests.shards import SHARD_SUFFIX, shard_records


def _spec(folder: Path, source: Path, extra: str = "") -> Path:
    from tests.conftest import write_minimal_spec

    spec = write_minimal_spec(folder)
    text = spec.read_text()
    start = text.index("uri: ") + len("uri: ")
    end = text.index("\n", start)
    spec.write_text(text[:start] + str(source) + extra + text[end:])
    return spec


def _one_page(tmp_path: Path, text: str) -> tuple[Path, Path]:
    """(the page, the minimal spec whose `notes` source is a folder holding only that page)."""
    source = tmp_path / "notes"
    source.mkdir()
    page = source / "a.txt"
    page.write_text(text)
    return page, _spec(tmp_path, source)


def _ingest_fingerprint(spec: Path) -> str:
    from compass.flows.compiler import compile_spec

    plan = compile_spec(load_spec(spec).spec)
    return plan.fingerprints["ingest:notes"]


def test_an_edited_added_or_removed_file_changes_the_ingest_identity(tmp_path: Path):
    page, spec = _one_page(tmp_path, "The first version of a document about learning rates.")
    source = page.parent
    first = _ingest_fingerprint(spec)
    assert _ingest_fingerprint(spec) == first  # untouched: the same identity, the cache holds
    (source / "notes.md").write_text("not selected by include: *.txt")
    assert _ingest_fingerprint(spec) == first

    page.write_text("The second version of a document about learning rates!")
    edited = _ingest_fingerprint(spec)
    assert edited != first
    (source / "b.txt").write_text("another document")
    added = _ingest_fingerprint(spec)
    assert added not in (first, edited)
    (source / "b.txt").unlink()
    os.utime(page, ns=(page.stat().st_atime_ns, page.stat().st_mtime_ns + 10**9))  # touched: read again
    assert _ingest_fingerprint(spec) not in (first, added)


def test_an_edited_source_is_ingested_again_with_its_new_text(tmp_path: Path):
    from compass.flows.compiler import compile_spec
    from compass.flows.runner import run_in_process
    from compass.infra.store import Store
    from compass.tasks.steps.context import Runtime

    page, spec = _one_page(tmp_path, "Warmup then decay: the old text of the only document.")
    store = Store(str(tmp_path / "store"))

    def ingest() -> str:
        loaded = load_spec(spec)
        plan = compile_spec(loaded.spec).restricted_to({"ingest"})
        outcomes = run_in_process(plan, store, loaded.spec_hash, Runtime(how=loaded.spec.how,
                                                                         base_dir=loaded.base_dir),
                                  logging.getLogger("test"))
        shards = sorted((Path(outcomes["ingest:notes"].uri) / "documents").glob("*" + SHARD_SUFFIX))
        return " ".join(record["text"] for s in shards for record in shard_records(s))

    assert "old text" in ingest()
    page.write_text("Warmup then decay: the new text of the only document.")
    assert "new text" in ingest()


def test_a_listing_written_by_hand_is_refused(tmp_path: Path):
    source = tmp_path / "notes"
    source.mkdir()
    (source / "a.txt").write_text("text")
    spec = _spec(tmp_path, source, extra="\n        listing: 0123abcd")
    with pytest.raises(SpecError, match=r"what.data.sources\[0\].listing: listing is filled in by compass"):
        load_spec(spec)
