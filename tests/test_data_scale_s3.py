"""With the store on S3 (moto's server on 127.0.0.1), curation (datatrove's readers), tokenizer selection and
tokenization stream their inputs from the store: no copy of an ingested or curated source is made on the step's
machine, and the tokens are the same bytes as a run on a local store. An object whose bytes changed after its
commit (same size, so the listing cannot tell) is caught before a step reads it (its ETag is not the one stamped
at the commit, so it is hashed again, streamed) and by any read to its end."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import pytest

from compass.infra.net import free_port
from tests.conftest import REPO
from tests.s3_server import RestartableS3

pytestmark = pytest.mark.slow
BUCKET = "compass-data"


@pytest.fixture(scope="module")
def s3() -> Iterator[RestartableS3]:
    server = RestartableS3(free_port())
    server.start()
    server.create_bucket(BUCKET)
    try:
        yield server
    finally:
        server.stop()


def _data_steps(store):
    """The minimal spec's data steps run into `store`; returns the plan."""
    from compass.flows.compiler import compile_spec
    from compass.flows.runner import run_in_process
    from compass.specs import load_spec
    from compass.tasks.steps.context import Runtime

    loaded = load_spec(REPO / "tests" / "specs" / "minimal.yaml")
    plan = compile_spec(loaded.spec)
    run_in_process(plan.restricted_to({"ingest", "curate", "tokenizer", "tokenize"}), store, loaded.spec_hash,
                   Runtime(how=loaded.spec.how, base_dir=loaded.base_dir), logging.getLogger("test"))
    return plan


def test_curated_shards_are_streamed_from_s3_never_copied_and_tokenize_as_on_a_local_store(
        s3: RestartableS3, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    from compass.infra.store import Store

    for key, value in s3.env.items():
        monkeypatch.setenv(key, value)
    remote, local = Store(f"s3://{BUCKET}/streamed", scratch_root=tmp_path / "scratch"), Store(str(tmp_path / "l"))
    plan = _data_steps(remote)
    _data_steps(local)

    data = {plan.fingerprints[s.id] for s in plan.steps if s.kind in ("ingest", "curate")}
    copies = [p.name for p in (tmp_path / "scratch" / "cache").iterdir()]
    assert copies, "the run made no local copies at all: the check below would prove nothing"
    assert not [c for c in copies if c.split("-")[0] in data], copies  # the tokenizer's copy only
    tokenized = [s for s in plan.steps if s.kind == "tokenize"]
    assert {s.name for s in tokenized} == {"notes", "code"}
    for step in tokenized:
        on_s3 = remote.read_manifest(remote.uri("tokenize", step.name, plan.fingerprints[step.id])).files
        on_disk = local.read_manifest(local.uri("tokenize", step.name, plan.fingerprints[step.id])).files
        assert [(f.path, f.sha256) for f in on_s3] == [(f.path, f.sha256) for f in on_disk]  # bit for bit


COMMITTED, REPLACED = b"committed bytes " * 1000, b"replaced bytes! " * 1000  # the same size


def _one_file_artifact(prefix: str, scratch: Path):
    """(store, manifest) of an artifact on S3 holding one file `documents/00000.jsonl.gz` of COMMITTED bytes."""
    from compass.infra.store import Store
    from tests.test_store import manifest_for

    store = Store(f"s3://{BUCKET}/{prefix}", scratch_root=scratch)
    with store.staging() as out:
        (out / "documents").mkdir()
        (out / "documents" / "00000.jsonl.gz").write_bytes(COMMITTED)
        return store, store.commit(out, manifest_for(store, "ingest", "web", "d" * 64))


def _replace(store, manifest) -> None:
    store.fs.pipe_file(f"{store._path(manifest.uri)}/{manifest.files[0].path}", REPLACED)


def test_a_shard_changed_on_s3_after_its_commit_fails_the_read_at_its_end(
        s3: RestartableS3, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    from compass.infra.verified_read import ChangedSinceCommit

    for key, value in s3.env.items():
        monkeypatch.setenv(key, value)
    store, manifest = _one_file_artifact("tampered", tmp_path)
    with store.open_committed(manifest.uri, manifest.files[0]) as f:
        assert f.read() == COMMITTED  # intact: read to its end without complaint
    _replace(store, manifest)
    with pytest.raises(ChangedSinceCommit, match="differs from its manifest"), \
            store.open_committed(manifest.uri, manifest.files[0]) as f:
        f.read()


def test_an_object_changed_on_s3_after_its_commit_is_caught_by_its_etag_before_a_step_reads_it(
        s3: RestartableS3, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    from compass.infra import verify

    for key, value in s3.env.items():
        monkeypatch.setenv(key, value)
    store, manifest = _one_file_artifact("stamped", tmp_path)
    verify.stamp(store, manifest)  # as every commit does: the objects' ETags
    assert verify.damage(store, manifest.uri, "stamped") == []
    _replace(store, manifest)
    assert verify.damage(store, manifest.uri, "sizes") == []  # the listing alone cannot tell
    assert verify.damage(store, manifest.uri, "stamped") == [
        "documents/00000.jsonl.gz: contents changed since the commit (sha256 differs)"]
