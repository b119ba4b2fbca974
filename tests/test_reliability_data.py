"""Bad data is named, not smoothed over or retried: binary and non-UTF-8 files are skipped and counted, a broken
JSONL line or parquet file is an error with file and line, and such errors do not use the retry budget."""

from __future__ import annotations

import gzip
import json
import logging
from pathlib import Path

import pytest

from compass.infra.errors import DataError, MalformedData
from compass.specs.how import How
from compass.tasks.kinds.ingest import IngestConfig, run_ingest
from compass.tasks.steps.context import Runtime, StepContext
from tests.shards import SHARD_SUFFIX, shard_records


def ingest(folder: Path, tmp_path: Path, fmt: str, include: list[str], max_document_chars: int = 2_000_000):
    config = IngestConfig(uri=str(folder), include=include, exclude=[], format=fmt, text_key="text", split="file",
                          section_chars=4000, language=None, domain="web", max_documents=None,
                          max_document_chars=max_document_chars)
    out = tmp_path / "out"
    out.mkdir()
    ctx = StepContext("ingest", "web", config, {}, out, tmp_path, tmp_path, Runtime(how=How(), base_dir=tmp_path),
                      logging.getLogger("test"))
    return run_ingest(ctx)


def test_binary_and_non_utf8_files_are_skipped_and_counted(tmp_path: Path):
    data = tmp_path / "data"
    data.mkdir()
    (data / "a.txt").write_text("A real document about tokenizers, long enough to keep. " * 5)
    (data / "b.txt").write_bytes(bytes(range(256)) * 40)  # a binary that matched *.txt
    (data / "c.txt").write_bytes("caf\xe9 au lait, in Latin-1".encode("latin-1"))
    result = ingest(data, tmp_path, "text", ["*.txt"])
    assert result.metrics["documents"] == 1 and result.metrics["skipped_files"] == 2
    assert result.metrics["skipped"] == {"b.txt": "binary: NUL bytes", "c.txt": "not UTF-8: byte 0xe9 at offset 3"}
    texts = [record["text"] for s in (tmp_path / "out" / "documents").glob("*" + SHARD_SUFFIX)
             for record in shard_records(s)]
    assert not any("\ufffd" in t for t in texts)


def test_only_binary_files_is_a_data_error(tmp_path: Path):
    data = tmp_path / "data"
    data.mkdir()
    (data / "b.txt").write_bytes(b"\0\1\2" * 100)
    with pytest.raises(DataError, match=r"1 files matched but none held text \(1 skipped as binary or not UTF-8\)"):
        ingest(data, tmp_path, "text", ["*.txt"])


@pytest.mark.parametrize(("line", "why"), [
    ('{"text": "fine"}\n{"text": "broken\n', r"docs.jsonl:2: not a JSON record: Unterminated string"),
    ('{"text": "fine"}\n["a list"]\n', r"docs.jsonl:2: a JSON list, not an object with 'text'"),
    (b'{"text": "fine"}\n{"text": "caf\xe9"}\n', r"docs.jsonl:2: not UTF-8 \(byte 0xe9 at column 14\)"),
])
def test_a_malformed_jsonl_line_is_named_with_file_and_line(tmp_path: Path, line, why: str):
    data = tmp_path / "data"
    data.mkdir()
    path = data / "docs.jsonl"
    path.write_bytes(line if isinstance(line, bytes) else line.encode())
    with pytest.raises(MalformedData, match=why):
        ingest(data, tmp_path, "jsonl", ["*.jsonl"])


def test_a_file_that_is_not_parquet_is_named(tmp_path: Path):
    data = tmp_path / "data"
    data.mkdir()
    (data / "part-0.parquet").write_text("not parquet at all")
    with pytest.raises(MalformedData, match=r"part-0.parquet: not a parquet file with a 'text' column"):
        ingest(data, tmp_path, "parquet", ["*.parquet"])


def test_data_errors_do_not_use_the_retry_budget():
    from prefect.states import Failed

    from compass.flows.lifecycle import worth_retrying
    from compass.infra.remote import RemoteMissing

    assert worth_retrying(None, None, Failed(data=ConnectionResetError("the server went away")))
    assert worth_retrying(None, None, Failed(data=RuntimeError("training failed on 127.0.0.1 (-9)")))
    assert not worth_retrying(None, None, Failed(data=MalformedData("docs.jsonl:2: not a JSON record")))
    assert not worth_retrying(None, None, Failed(data=RemoteMissing("s3://b/x: no objects there")))


def test_a_giant_single_line_document_is_skipped_and_counted(tmp_path: Path):
    from compass.tasks.kinds.ingest import MAX_DOCUMENT_CHARS

    data = tmp_path / "data"
    data.mkdir()
    (data / "page.txt").write_text("An ordinary page of text. " * 20)
    (data / "dump.txt").write_text("x" * (MAX_DOCUMENT_CHARS + 1))
    result = ingest(data, tmp_path, "text", ["*.txt"])
    assert result.metrics["documents"] == 1 and result.metrics["skipped_too_long"] == 1


def test_a_full_disk_is_one_message_with_the_path_and_not_retried(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    import errno

    from prefect.states import Failed

    from compass.flows import runner
    from compass.flows.lifecycle import worth_retrying
    from compass.infra.errors import DiskFull
    from compass.tasks.steps.context import StepResult
    from tests.test_store import one_step

    def fills_the_disk(ctx) -> StepResult:
        raise OSError(errno.ENOSPC, "No space left on device", str(ctx.out / "train" / "00001.tokens"))

    ctx, step = one_step(tmp_path, monkeypatch, fills_the_disk)
    with pytest.raises(DiskFull, match=r"slow:web: no space left on the device of .*00001.tokens \([\d,]+ MiB free"):
        runner.run_step(ctx, step, logging.getLogger("test"))
    assert not worth_retrying(None, None, Failed(data=DiskFull(errno.ENOSPC, "full")))
    assert not ctx.store.is_committed(runner.step_uri(ctx, step))


def test_a_full_disk_met_by_a_folder_copy_is_named_too(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """shutil.copytree (a training step's export into its artifact) gathers each file's OSError into one
    shutil.Error, as text: a full disk there is the same one message, not a list of tracebacks retried at once."""
    import errno
    import shutil

    from compass.flows import runner
    from compass.infra.errors import DiskFull
    from compass.tasks.steps.context import StepResult
    from tests.test_store import one_step

    export = tmp_path / "export"
    export.mkdir()
    (export / "model.safetensors").write_bytes(b"weights")

    def no_space(source: str, target: str) -> None:
        raise OSError(errno.ENOSPC, "No space left on device", target)

    def copies_onto_a_full_disk(ctx) -> StepResult:
        shutil.copytree(export, ctx.out / "final", copy_function=no_space)
        return StepResult()

    ctx, step = one_step(tmp_path, monkeypatch, copies_onto_a_full_disk)
    with pytest.raises(DiskFull, match=r"no space left on the device of .*final/model.safetensors \([\d,]+ MiB free"):
        runner.run_step(ctx, step, logging.getLogger("test"))


def test_a_full_disk_met_by_safetensors_writer_is_named_too(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """safetensors' Rust writer (a TRL step's export) raises its own SafetensorError, naming only the OS error: found
    by chaos.py's disk-full kind on a GRPO step, retried at once and printed as a traceback. (The message is the one
    it raises on a full tmpfs.)"""
    from safetensors import SafetensorError

    from compass.flows import runner
    from compass.infra.errors import DiskFull
    from compass.tasks.steps.context import StepResult
    from tests.test_store import one_step

    def exports_onto_a_full_disk(ctx) -> StepResult:
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    ctx, step = one_step(tmp_path, monkeypatch, exports_onto_a_full_disk)
    with pytest.raises(DiskFull, match=r"slow:web: no space left on the device of .*staging.* \([\d,]+ MiB free"):
        runner.run_step(ctx, step, logging.getLogger("test"))


def _jsonl(path: Path, texts: list[str]) -> None:
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))


def test_records_with_nul_bytes_or_mostly_replacement_characters_are_dropped_by_reason(tmp_path: Path):
    data = tmp_path / "data"
    data.mkdir()
    good = "A paragraph about attention heads and their key-value groups. " * 4
    stray = good + "one stray \ufffd from a copy and paste"  # one replacement character is not noise
    _jsonl(data / "a.jsonl", [good, "header\0\0\0binary tail" + good, "\ufffd" * 30 + good[:200], stray,
                              "x" * 900])
    result = ingest(data, tmp_path, "jsonl", ["*.jsonl"], max_document_chars=800)
    assert result.metrics["documents"] == 2
    assert result.metrics["dropped"] == {"nul_bytes": 1, "replacement_characters": 1, "too_long": 1}
    stats = json.loads((tmp_path / "out" / "stats.json").read_text())
    assert stats["dropped_documents"] == result.metrics["dropped"]
    kept = [record["text"] for record in shard_records(tmp_path / "out" / "documents" / f"00000{SHARD_SUFFIX}")]
    assert kept == [good, stray]


def test_a_giant_line_is_read_past_with_memory_bounded_by_the_cap(tmp_path: Path):
    """A 48 MB one-line record with a 10,000-character cap: Python never holds more than a few cap-sized
    pieces (tracemalloc counts every bytes and str object), and the records after it are still read."""
    import tracemalloc

    data = tmp_path / "data"
    data.mkdir()
    with (data / "dump.jsonl").open("w") as f:
        f.write(json.dumps({"text": "first record, small and fine"}) + "\n")
        f.write('{"text": "' + "y" * (48 << 20) + '"}\n')
        f.write(json.dumps({"text": "last record, after the giant"}) + "\n")
    with gzip.open(data / "bundle.txt.gz", "wt") as f:  # a compressed file that inflates past the cap
        f.write("z" * (8 << 20))
    (data / "page.txt").write_text("An ordinary page that fits well within the cap. " * 10)
    tracemalloc.start()
    try:
        lines = ingest(data, tmp_path, "jsonl", ["*.jsonl"], max_document_chars=10_000)
        _, peak_jsonl = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        (tmp_path / "out").rename(tmp_path / "out-jsonl")
        text = ingest(data, tmp_path, "text", ["*.gz", "*.jsonl", "*.txt"], max_document_chars=10_000)
        _, peak_text = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert lines.metrics["documents"] == 2 and lines.metrics["dropped"] == {"too_long": 1}
    # as text: the gz file and the jsonl file are each one document over the cap
    assert text.metrics["documents"] == 1 and text.metrics["dropped"]["too_long"] == 2
    assert peak_jsonl < 8 << 20, f"peak {peak_jsonl / 2**20:.1f} MiB for a 48 MiB line"
    assert peak_text < 8 << 20, f"peak {peak_text / 2**20:.1f} MiB for an 8 MiB compressed text"


def test_parquet_records_are_read_by_row_group_and_checked(tmp_path: Path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    data = tmp_path / "data"
    data.mkdir()
    texts = [f"document number {i} about learning rate warmup and decay" for i in range(3000)] + ["bad\0record"]
    pq.write_table(pa.table({"text": texts}), data / "part-0.parquet", row_group_size=500)
    result = ingest(data, tmp_path, "parquet", ["*.parquet"])
    assert result.metrics["documents"] == 3000 and result.metrics["dropped"] == {"nul_bytes": 1}


def test_parquet_records_of_a_megabyte_are_held_a_batch_of_bytes_at_a_time(tmp_path: Path):
    """120 records of 1 MB in one row group: Python holds a record at a time, not the row group's 120 MB (1,024
    such records once peaked at 2.6 GB)."""
    import tracemalloc

    import pyarrow as pa
    import pyarrow.parquet as pq

    data = tmp_path / "data"
    data.mkdir()
    texts = [f"record {i} " + "word " * 200_000 for i in range(120)]
    pq.write_table(pa.table({"text": texts}), data / "big.parquet")
    del texts
    tracemalloc.start()
    try:
        result = ingest(data, tmp_path, "parquet", ["*.parquet"])
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert result.metrics["documents"] == 120
    assert peak < 40 << 20, f"peak {peak / 2**20:.0f} MiB of Python objects for 120 MB of records"


@pytest.mark.slow
def test_compass_run_of_a_malformed_jsonl_line_prints_one_message_and_no_traceback(prefect_server: str,
                                                                                   tmp_path: Path):
    from compass.tasks.data.source_check import SAMPLED_RECORDS
    from tests.conftest import Cli, base_env, write_minimal_spec

    data = tmp_path / "data"
    data.mkdir()
    docs = data / "docs.jsonl"
    docs.write_text('{"text": "A fine first document."}\n{"text": "broken\n')
    spec = write_minimal_spec(tmp_path, **{"        include: [\"*.txt\"]\n        format: text":
                                           "        include: [\"*.jsonl\"]\n        format: jsonl"})
    spec.write_text(spec.read_text().replace(spec.read_text().split("uri: ")[1].split("\n")[0], str(data), 1))
    cli = Cli(tmp_path, base_env(tmp_path / "home") | {"COLUMNS": "400", "PREFECT_API_URL": prefect_server})
    refused = cli("run", str(spec), "--until", "ingest:notes", "--store", str(tmp_path / "store"), check=False,
                  timeout=600)  # validation reads the file's first records (tasks/data/source_check.py)
    assert refused.returncode == 2 and "docs.jsonl:2: not a JSON record" in refused.stderr, refused.stderr[-3000:]
    # past what validation reads, the line stops ingest: one message, no traceback
    broken = SAMPLED_RECORDS + 2
    docs.write_text('{"text": "A fine document."}\n' * (broken - 1) + '{"text": "broken\n')
    done = cli("run", str(spec), "--until", "ingest:notes", "--store", str(tmp_path / "store"), check=False,
               timeout=600)
    output = done.stdout + done.stderr
    assert done.returncode == 1, output[-3000:]
    assert f"failed: {spec}: " in done.stderr and f"docs.jsonl:{broken}: not a JSON record" in done.stderr, \
        output[-3000:]
    assert "Traceback" not in output, output[-3000:]
    assert not list((tmp_path / "store").glob("ingest/notes-*/manifest.json"))  # nothing committed for it


def test_prefect_run_loggers_print_a_data_error_without_its_traceback(prefect_logs: pytest.LogCaptureFixture):
    """What Prefect's engines log when a task or flow fails: a full disk keeps its one message, any other error
    keeps its traceback."""
    import errno

    from compass.infra.errors import DiskFull
    from compass.infra.quiet_failures import quiet_data_errors

    quiet_data_errors()
    task_runs = logging.getLogger("prefect.task_runs")
    for error in (DiskFull(errno.ENOSPC, "no space left on the device of /store (0 MiB free)"), KeyError("x")):
        try:
            raise error
        except Exception as exc:
            task_runs.error("Task run failed with exception: %r", exc, exc_info=True)
    full, other = [r for r in prefect_logs.records if r.name == "prefect.task_runs"]
    assert full.exc_info is None and "0 MiB free" in full.getMessage()
    assert other.exc_info is not None and other.exc_info[0] is KeyError
