"""Ingest as a datatrove stage: the source's files cut into contiguous groups of about equal bytes, one task and one
shard each; how many from the data and the spec (not from a fixed number of documents per shard); the shards in
order hold the documents in file order; a relaunch after a failed task redoes only that task, and what it writes
is byte-identical to an undisturbed run."""

from __future__ import annotations

import gzip
import json
import logging
from pathlib import Path

import pytest

from compass.infra.errors import MalformedData
from compass.specs.how import How
from compass.tasks.kinds import ingest as ingest_kind
from compass.tasks.kinds.ingest import IngestConfig, file_groups, run_ingest, task_count
from compass.tasks.steps.context import Runtime, StepContext
from tests.shards import SHARD_SUFFIX, decompress


def _context(source: Path, work: Path, how: How | None = None, max_documents: int | None = None) -> StepContext:
    config = IngestConfig(uri=str(source), include=["*.jsonl"], exclude=[], format="jsonl", text_key="text",
                          split="file", section_chars=4000, language=None, domain="web", max_documents=max_documents)
    out = work / "out"
    out.mkdir(parents=True)
    return StepContext("ingest", "web", config, {}, out, work, work, Runtime(how=how or How(), base_dir=work),
                       logging.getLogger("test"))


def _source(folder: Path, files: int = 5, per_file: int = 40) -> list[str]:
    folder.mkdir()
    texts = []
    for i in range(files):
        lines = [f"document {j} of file {i}: " + "words " * (10 + j) for j in range(per_file)]
        (folder / f"part-{i:02d}.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in lines))
        texts += lines
    return texts


def _shards(out: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted((out / "documents").glob("*" + SHARD_SUFFIX))}


def _texts(shards: dict[str, bytes]) -> list[str]:
    return [json.loads(line)["text"] for data in shards.values() for line in decompress(data).splitlines()]


def test_files_are_cut_into_contiguous_groups_of_about_equal_bytes():
    assert file_groups({"a": 10, "b": 10, "c": 10, "d": 10}, 2) == [["a", "b"], ["c", "d"]]
    assert file_groups({"a": 100, "b": 1, "c": 1, "d": 1}, 3) == [["a"], ["b"], ["c", "d"]]  # a big file alone
    assert file_groups({"a": 5}, 4) == [["a"]]  # a file is never split
    groups = file_groups({f"{i:03d}": 1 + i % 7 for i in range(100)}, 8)
    assert len(groups) == 8 and [f for g in groups for f in g] == [f"{i:03d}" for i in range(100)]


def test_tasks_come_from_the_data_size_and_the_data_phase(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    files = {f"{i:02d}.jsonl": 1000 for i in range(20)}
    local = _context(tmp_path / "src", tmp_path / "a")
    assert task_count(files, local) == 2  # small data: the data phase's CPUs (orchestration.workers)
    wide = How.model_validate({"resources": {"data": {"nodes": 2, "cpus_per_node": 4}}})
    assert task_count(files, _context(tmp_path / "src", tmp_path / "b", wide)) == 8  # the same wherever it runs
    monkeypatch.setattr(ingest_kind, "TASK_BYTES", 2000)
    assert task_count(files, local) == 10  # more data: a task per TASK_BYTES, at most one per file
    assert task_count({"one.jsonl": 10**9}, local) == 1
    assert task_count(files, _context(tmp_path / "src", tmp_path / "c", max_documents=5)) == 1


def test_ingest_runs_one_task_per_group_and_a_relaunch_redoes_only_the_failed_task(tmp_path: Path):
    source = tmp_path / "source"
    texts = _source(source)
    good = (source / "part-04.jsonl").read_text()
    (source / "part-04.jsonl").write_text(good + '{"text": "broken\n')  # in the second group: rank 1 fails
    ctx = _context(source, tmp_path / "run")
    with pytest.raises(MalformedData, match=r"part-04.jsonl:41: not a JSON record"):
        run_ingest(ctx)
    work = tmp_path / "run" / "datatrove"
    done = sorted(p.name for p in (work / "logs" / "ingest" / "completions").iterdir())
    assert done == ["00000"]
    first = (work / "documents" / f"00000{SHARD_SUFFIX}").stat()

    (source / "part-04.jsonl").write_text(good)  # fixed; the relaunch reads the same files
    result = run_ingest(ctx)
    again = (work / "documents" / f"00000{SHARD_SUFFIX}").stat()
    assert (again.st_ino, again.st_mtime_ns) == (first.st_ino, first.st_mtime_ns)  # rank 0 was not redone
    assert result.metrics["tasks"] == 2 and result.metrics["shards"] == 2 and result.metrics["documents"] == 200
    shards = _shards(ctx.out)
    assert list(shards) == [f"00000{SHARD_SUFFIX}", f"00001{SHARD_SUFFIX}"]
    assert _texts(shards) == texts  # the shards in order: the source's files in order
    ids = [json.loads(line)["id"] for data in shards.values() for line in decompress(data).splitlines()]
    assert ids[0] == "web/part-00.jsonl#0" and ids[-1] == "web/part-04.jsonl#39"

    undisturbed = _context(source, tmp_path / "fresh")
    run_ingest(undisturbed)
    assert _shards(undisturbed.out) == shards  # byte for byte: reproducible zstd


def test_max_documents_takes_the_first_documents_in_file_order(tmp_path: Path):
    source = tmp_path / "source"
    texts = _source(source)
    ctx = _context(source, tmp_path / "run", max_documents=50)
    result = run_ingest(ctx)
    assert result.metrics["tasks"] == 1 and _texts(_shards(ctx.out)) == texts[:50]


def _warc(path: Path, pages: list[tuple[str, str]], image: bool = True) -> None:
    """A gzipped web archive as crawlers write it: per page a request and its HTML response, and an image."""
    from io import BytesIO

    from warcio.statusandheaders import StatusAndHeaders
    from warcio.warcwriter import WARCWriter

    with open(path, "wb") as f:
        writer = WARCWriter(f, gzip=True)
        for url, html in pages:
            request = StatusAndHeaders("GET / HTTP/1.1", [("Host", "example.org")], is_http_request=True)
            writer.write_record(writer.create_warc_record(url, "request", http_headers=request))
            headers = StatusAndHeaders("200 OK", [("Content-Type", "text/html; charset=utf-8")], protocol="HTTP/1.1")
            writer.write_record(writer.create_warc_record(url, "response", payload=BytesIO(html.encode()),
                                                          http_headers=headers))
        if image:
            headers = StatusAndHeaders("200 OK", [("Content-Type", "image/png")], protocol="HTTP/1.1")
            writer.write_record(writer.create_warc_record("https://example.org/logo.png", "response",
                                                          payload=BytesIO(b"\x89PNG\r\n\x1a\n" + bytes(64)),
                                                          http_headers=headers))


def test_web_archives_become_one_document_per_html_page_with_its_url(tmp_path: Path):
    source = tmp_path / "crawl"
    source.mkdir()
    pages = [(f"https://example.org/{i}", f"<html><head><script>var x = {i};</script></head><body><nav>menu</nav>"
              f"<h1>Page {i}</h1><p>{'text of the page ' * 20}{i}</p></body></html>") for i in range(5)]
    _warc(source / "CC-MAIN-0000.warc.gz", pages[:3])
    _warc(source / "CC-MAIN-0001.warc.gz", pages[3:], image=False)
    (source / "broken.warc.gz").write_bytes(gzip.compress(b"this is no web archive\n"))
    config = IngestConfig(uri=str(source), include=["CC-MAIN-*.warc.gz"], exclude=[], format="warc",
                          text_key="text", split="file", section_chars=4000, language="en", domain="web",
                          max_documents=None)
    out = tmp_path / "out"
    out.mkdir()
    ctx = StepContext("ingest", "crawl", config, {}, out, tmp_path, tmp_path, Runtime(how=How(), base_dir=tmp_path),
                      logging.getLogger("test"))
    result = run_ingest(ctx)
    assert result.metrics["documents"] == 5 and result.metrics["dropped"] == {"not_html": 1}
    records = [json.loads(line) for shard in _shards(out).values() for line in decompress(shard).splitlines()]
    assert [r["metadata"]["url"] for r in records] == [url for url, _ in pages]
    assert records[0]["text"].startswith("Page 0") and "var x" not in records[0]["text"]
    assert "menu" not in records[0]["text"] and records[0]["metadata"]["date"]
    config = config.model_copy(update={"include": ["broken.warc.gz"]})
    broken = StepContext("ingest", "broken", config, {}, tmp_path / "out2", tmp_path / "w2", tmp_path / "w2",
                         Runtime(how=How(), base_dir=tmp_path), logging.getLogger("test"))
    (tmp_path / "out2").mkdir()
    with pytest.raises(MalformedData, match=r"broken.warc.gz: not a web archive \(WARC\)"):
        run_ingest(broken)
