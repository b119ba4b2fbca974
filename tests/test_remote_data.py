"""Datasets a spec names by s3:// URI, on a real S3-compatible server on loopback: copied once into the cache,
copied again when an object changes, and a URI with nothing under it is an error that names it."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from compass.infra.net import free_port
from tests.s3_server import RestartableS3


@pytest.fixture
def s3(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[RestartableS3]:
    server = RestartableS3(free_port())
    server.start()
    for key, value in server.env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("COMPASS_CACHE", str(tmp_path / "cache"))
    server.create_bucket("data")
    import s3fs

    s3fs.S3FileSystem.clear_instance_cache()  # instances remember the endpoint of an earlier test's server
    try:
        yield server
    finally:
        server.stop()


def test_an_s3_dataset_is_copied_once_and_again_when_it_changes(s3: RestartableS3):
    from compass.tasks.post_training.datasets import chat_examples, dataset_root

    line = {"messages": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]}
    s3.client().put_object(Bucket="data", Key="sft/a/train.jsonl", Body=json.dumps(line) + "\n")
    root, provenance = dataset_root("s3://data/sft", Path("/nonexistent"))
    assert provenance == {"kind": "s3", "uri": "s3://data/sft"}
    assert (root / "a" / "train.jsonl").read_text().strip() == json.dumps(line)
    assert chat_examples(root, None, seed=0, max_chars=100) == [line["messages"]]
    assert dataset_root("s3://data/sft", Path("/nonexistent"))[0] == root  # unchanged: the same copy
    s3.client().put_object(Bucket="data", Key="sft/a/train.jsonl", Body=(json.dumps(line) + "\n") * 2)
    again, _ = dataset_root("s3://data/sft", Path("/nonexistent"))
    assert again != root and len(chat_examples(again, None, seed=0, max_chars=100)) == 2


def test_a_missing_s3_dataset_names_its_uri(s3: RestartableS3):
    from compass.infra.remote import RemoteMissing
    from compass.tasks.post_training.datasets import dataset_root

    with pytest.raises(RemoteMissing, match=r"s3://data/nothing-here: no objects there \(check the bucket"):
        dataset_root("s3://data/nothing-here", Path("."))
    with pytest.raises(RemoteMissing, match="s3://no-such-bucket/x"):
        dataset_root("s3://no-such-bucket/x", Path("."))


def test_an_s3_source_with_no_matching_files_names_its_uri(s3: RestartableS3, tmp_path: Path):
    import logging

    from compass.specs.how import How
    from compass.tasks.kinds.ingest import IngestConfig, run_ingest
    from compass.tasks.steps.context import Runtime, StepContext

    s3.client().put_object(Bucket="data", Key="web/readme.md", Body=b"not parquet")
    config = IngestConfig(uri="s3://data/web", include=["*.parquet"], exclude=[], format="parquet", text_key="text",
                          split="file", section_chars=0, language=None, domain="web", max_documents=None)
    ctx = StepContext("ingest", "web", config, {}, tmp_path / "out", tmp_path, tmp_path,
                      Runtime(how=How()), logging.getLogger("test"))
    from compass.infra.errors import DataError

    with pytest.raises(DataError, match=r"no files under s3://data/web match include=\['\*\.parquet'\]"):
        run_ingest(ctx)


def test_a_remote_artifact_rebuilt_under_its_fingerprint_is_downloaded_again(s3: RestartableS3, tmp_path: Path):
    """An s3:// source changed underneath keeps its steps' fingerprints: the local copy must follow the files."""
    from compass.infra.store import Store
    from tests.test_store import manifest_for

    store = Store("s3://data/store")
    copies = []
    for text in ("first", "second"):
        if store.is_committed(store.uri("tokenize", "web", "f" * 64)):
            store.fs.rm(store.uri("tokenize", "web", "f" * 64).removeprefix("s3://"), recursive=True)
        with store.staging() as out:
            (out / "heldout.txt").write_text(text)
            store.commit(out, manifest_for(store, "tokenize", "web", "f" * 64))
        copies.append(store.local_path(store.uri("tokenize", "web", "f" * 64), cache_dir=tmp_path / "cache"))
    assert [(c / "heldout.txt").read_text() for c in copies] == ["first", "second"]
