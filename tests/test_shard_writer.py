"""compass's datatrove blocks for document shards: ShardWriter writes the bytes datatrove's JsonlWriter writes
(without its deep copy of each record), the curated record drops the reader's path without touching the document,
and curation measures a document once when its input and its split see the same text."""

from __future__ import annotations

from pathlib import Path

import pytest
from datatrove.data import Document
from datatrove.pipeline.base import PipelineStep
from datatrove.pipeline.writers import JsonlWriter

import compass.tasks.data.curate_blocks as blocks
from compass.tasks.data.curate_blocks import Measure, ShardWriter, SplitTagger, portable_record
from compass.tasks.data.shard_codec import SHARD_CODEC
from tests.shards import SHARD_SUFFIX, decompress, shard_records


def _documents() -> list[Document]:
    return [Document(text="one two three", id="a", metadata={"file_path": "/abs/a.jsonl", "nested": {"k": [1, 2]}}),
            Document(text="four", id="b"),
            Document(text="", id="c", metadata={"language": "en"}),
            Document(text="five six", id="", metadata={"score": 0.5, "empty": None})]


def _write(writer: JsonlWriter, docs: list[Document]) -> None:
    for _ in writer.run(iter(docs), rank=0, world_size=1):
        pass


def test_a_shard_holds_the_bytes_datatroves_writer_writes(tmp_path: Path):
    _write(ShardWriter(str(tmp_path / "ours")), _documents())
    _write(JsonlWriter(str(tmp_path / "theirs"), output_filename="${rank}" + SHARD_SUFFIX, compression=SHARD_CODEC),
           _documents())
    ours, theirs = (decompress((tmp_path / side / f"00000{SHARD_SUFFIX}").read_bytes()) for side in ("ours", "theirs"))
    assert ours == theirs and ours.count(b"\n") == 4


def test_a_curated_record_drops_the_readers_path_and_leaves_the_document_as_it_was(tmp_path: Path):
    docs = _documents()
    _write(ShardWriter(str(tmp_path / "curated"), adapter=portable_record), docs)
    records = shard_records(tmp_path / "curated" / f"00000{SHARD_SUFFIX}")
    assert records[0]["metadata"] == {"nested": {"k": [1, 2]}}
    assert docs[0].metadata["file_path"] == "/abs/a.jsonl"  # the pipeline's document keeps it


class _Rewrite(PipelineStep):
    """A formatter: every document's text replaced by one of twice the words."""

    name = "rewrite"

    def run(self, data, rank: int = 0, world_size: int = 1):
        for doc in data:
            doc.text = f"{doc.text} {doc.text}"
            yield doc


@pytest.mark.parametrize("rewritten", [False, True])
def test_curation_counts_a_documents_words_once_unless_its_text_changed(monkeypatch, rewritten: bool):
    counted: list[str] = []
    word = blocks.WORD

    class CountingPattern:
        def findall(self, text: str) -> list[str]:
            counted.append(text)
            return word.findall(text)

    monkeypatch.setattr(blocks, "WORD", CountingPattern())
    docs = [Document(text=f"w{i} " * (i + 1), id=str(i)) for i in range(5)]
    measure, split = Measure(), SplitTagger(0.5)
    pipeline = measure.run(iter(docs))
    for _ in split.run(_Rewrite().run(pipeline) if rewritten else pipeline):
        pass
    words_in = measure.stats.stats["words"].total
    words_out = sum(split.stats.stats[f"{side}_words"].total for side in ("train", "heldout"))
    assert words_in == sum(range(1, 6))
    assert words_out == (2 if rewritten else 1) * words_in
    assert len(counted) == (10 if rewritten else 5)  # the split measured again only the rewritten texts
