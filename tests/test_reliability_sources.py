"""A local source folder is read as the folder it is: a link inside it that leads outside is left out and named,
and so are the store's own files when the store lies inside the source folder (its manifests, locks and shards
are no training text)."""

from __future__ import annotations

import logging
from pathlib import Path

from compass.infra.store import Store
from compass.specs.how import How
from compass.tasks.kinds.ingest import IngestConfig, run_ingest
from compass.tasks.steps.context import Runtime, StepContext
from tests.shards import SHARD_SUFFIX, shard_records


def _ingest(source: Path, work: Path, store: Store | None = None):
    config = IngestConfig(uri=str(source), include=["**/*.txt", "*.txt", "**/*.json"], exclude=[], format="text",
                          text_key="text", split="file", section_chars=4000, language=None, domain="web",
                          max_documents=None)
    out = work / "out"
    out.mkdir(parents=True)
    ctx = StepContext("ingest", "web", config, {}, out, work, work, Runtime(how=How(), base_dir=work),
                      logging.getLogger("test"), store=store)
    result = run_ingest(ctx)
    texts = [record["text"] for shard in sorted((out / "documents").glob("*" + SHARD_SUFFIX))
             for record in shard_records(shard)]
    return result, texts


def test_a_link_that_leads_outside_the_source_folder_is_left_out_and_named(tmp_path: Path):
    outside = tmp_path / "secret.txt"
    outside.write_text("a private file outside the source, never training text")
    source = tmp_path / "source"
    (source / "docs").mkdir(parents=True)
    (source / "docs" / "page.txt").write_text("An ordinary document inside the source folder.")
    (source / "docs" / "inside-link.txt").symlink_to(source / "docs" / "page.txt")  # stays inside: read
    (source / "passwd.txt").symlink_to(outside)
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "note.txt").write_text("a folder outside, linked into the source")
    (source / "linked-folder").symlink_to(tmp_path / "elsewhere")
    result, texts = _ingest(source, tmp_path / "work")
    assert not [t for t in texts if "outside" in t]  # neither the linked file nor the linked folder's file
    assert texts.count("An ordinary document inside the source folder.") == 2
    assert result.metrics["skipped"]["passwd.txt"] == "a link to a file outside the source folder"


def test_the_store_inside_a_source_folder_is_never_read_as_a_source(tmp_path: Path):
    source = tmp_path / "source"
    source.mkdir()
    (source / "page.txt").write_text("The only training document of this source.")
    store = Store(str(source / "store"))
    store_file = source / "store" / "ingest" / "web-0123" / "stats.txt"
    store_file.parent.mkdir(parents=True)
    store_file.write_text("a file the store wrote: not a document")
    result, texts = _ingest(source, tmp_path / "work", store)
    assert texts == ["The only training document of this source."]
    assert result.metrics["skipped"] == {"store/ingest/web-0123/stats.txt": "a file of the store"}
