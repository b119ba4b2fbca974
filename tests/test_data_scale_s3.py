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
from tests.watching import Watch

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
    store.fs.pipe_file(f"{store.path_of(manifest.uri)}/{manifest.files[0].path}", REPLACED)


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


SOURCE_FILES, LINES_PER_FILE = 32, 160  # 32 files of ~200 KB: a 6 MB source read by 6 tasks (TASK_BYTES below)
DIRECT_SPEC = """
name: direct
why:
  reason: research
  question: Do shards go straight to the store?
  hypothesis: No local copy of a source is made.
  success_criteria: [{metric: "val_ppl:web", op: "<=", threshold: 1000, checkpoint: final}]
what:
  architecture: {num_layers: 2, hidden_size: 64, ffn_size: 128, num_heads: 4, num_kv_heads: 2}
  tokenizer:
    candidates: [{kind: bpe, vocab_size: 300}]
    train_chars: 100000
    eval_chars: 20000
  data:
    sources:
      - name: web
        uri: s3://BUCKET/raw/web
        include: ["*.jsonl"]
        format: jsonl
        language: en
        domain: web
        curation: {exact_dedup: true, minhash: {n_grams: 5, num_buckets: 2, hashes_per_bucket: 4},
                   heldout_fraction: 0.1}
  pretraining:
    stages: [{name: stage1, tokens: 20000, sequence_length: 64, global_batch_size: 4, mixture: {web: 1.0}}]
how:
  orchestration: {workers: 2, in_process_below_mib: 0}
""".replace("BUCKET", BUCKET)


def _word_salad_source(s3: RestartableS3) -> int:
    """SOURCE_FILES JSONL files of distinct made-up English-like documents on S3; returns their bytes."""
    import json
    import random

    rng = random.Random(7)
    syllables = ["ka", "lo", "mi", "ten", "ra", "su", "vel", "do", "pin", "ar", "es", "ton", "qui", "bel"]
    words = ["".join(rng.choices(syllables, k=rng.randint(1, 3))) for _ in range(3000)]
    total = 0
    for f in range(SOURCE_FILES):
        lines = [json.dumps({"text": " ".join(rng.choices(words, k=200)) + ".", "id": f"{f}-{i}"})
                 for i in range(LINES_PER_FILE)]
        body = ("\n".join(lines) + "\n").encode()
        s3.client().put_object(Bucket=BUCKET, Key=f"raw/web/{f:03d}.jsonl", Body=body)
        total += len(body)
    return total


class DiskWatch(Watch):
    """Samples the bytes under local folders while a run goes on: the peak total, and how many samples."""

    every_s = 0.02

    def __init__(self, *folders: Path):
        super().__init__()
        self.folders, self.peak, self.samples = folders, 0, 0

    def sample(self) -> None:
        import os

        total = 0
        for folder in self.folders:
            for root, _, names in os.walk(folder):
                for name in names:
                    try:
                        total += os.lstat(os.path.join(root, name)).st_size
                    except FileNotFoundError:
                        continue
        self.peak, self.samples = max(self.peak, total), self.samples + 1


def test_a_source_on_s3_becomes_shards_on_s3_with_no_local_copy_of_it(
        s3: RestartableS3, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """Ingest (datatrove readers streaming S3 objects), curation (its dedup stages' intermediates under the step's
    work prefix in the store) and tokenization write their shards straight into the artifacts' folders on S3:
    the step's disk holds logs, the tokenizer and at most a rank's token shard at a time, never a source."""
    import itertools
    import json
    import logging
    import tempfile

    import multiprocess.util
    import s3fs

    from compass.flows.compiler import compile_spec
    from compass.flows.runner import run_in_process
    from compass.infra import verify
    from compass.infra.store import Store
    from compass.specs import load_spec
    from compass.tasks.kinds import ingest
    from compass.tasks.steps.context import Runtime

    for key, value in s3.env.items():
        monkeypatch.setenv(key, value)
    s3fs.S3FileSystem.clear_instance_cache()
    source_bytes = _word_salad_source(s3)
    monkeypatch.setattr(ingest, "TASK_BYTES", source_bytes // 6 + 1)
    # multiprocess makes its folder for datatrove's Manager socket once per process, under the TMPDIR of that
    # moment, and keeps it for the process's life: made now, under this worker's own temporary folder (an AF_UNIX
    # path has 108 bytes at most, and the next tests of this worker must not find it gone with tmp_path)
    multiprocess.util.get_temp_dir()
    local_tmp, scratch = tmp_path / "tmp", tmp_path / "scratch"
    local_tmp.mkdir()
    monkeypatch.setenv("TMPDIR", str(local_tmp))  # where ranks write their token shards before the upload
    monkeypatch.setattr(tempfile, "tempdir", None)
    spec_file = tmp_path / "direct.yaml"
    spec_file.write_text(DIRECT_SPEC)
    loaded = load_spec(spec_file)
    plan = compile_spec(loaded.spec)
    store = Store(f"s3://{BUCKET}/direct", scratch_root=scratch)
    with DiskWatch(local_tmp, scratch) as watch:
        run_in_process(plan.restricted_to({"ingest", "curate", "tokenizer", "tokenize"}), store, loaded.spec_hash,
                       Runtime(how=loaded.spec.how, base_dir=tmp_path), logging.getLogger("test"))
    assert watch.samples > 20, "the run went too fast to be watched"
    assert watch.peak < source_bytes / 4, f"{watch.peak:,} bytes on local disk for a {source_bytes:,}-byte source"

    fingerprints = {s.kind: plan.fingerprints[s.id] for s in plan.steps if s.name == "web"}
    manifests = {kind: store.read_manifest(store.uri(kind, "web", fp)) for kind, fp in fingerprints.items()}
    assert manifests["ingest"].metrics["shards"] == 6 and manifests["ingest"].metrics["documents"] == \
        SOURCE_FILES * LINES_PER_FILE
    train_tokens = [e for e in manifests["tokenize"].files if e.path.startswith("train/")]
    assert len(train_tokens) == 2 * 6  # a tokens and an offsets file per curated shard
    counts = json.loads(store.read_bytes(manifests["tokenize"].uri, "train.counts.json"))  # per shard, in order
    assert len(counts["documents"]) == 6 and all(counts["documents"])
    assert sum(counts["documents"]) == manifests["tokenize"].metrics["train_documents"]
    assert sum(counts["tokens"]) == manifests["tokenize"].metrics["train_tokens"]
    from compass.model.training.token_files import TokenizedSource

    source = TokenizedSource(store.local_path(manifests["tokenize"].uri))
    for first in itertools.accumulate([0, *counts["documents"][:-1]]):  # each shard's counts agree with it
        assert source.document(first)[-1] == source.eos
    for manifest in manifests.values():  # the digests the writers recorded are the bytes on S3
        assert verify.damage(store, manifest.uri, "full") == [], manifest.uri
        on_s3 = {p.rsplit(manifest.uri.split("://", 1)[1] + "/", 1)[1] for p in store.fs.find(manifest.uri)}
        assert on_s3 - {"manifest.json"} == {e.path for e in manifest.files}  # nothing else in the folder
    assert not store.fs.glob(f"{BUCKET}/direct/.work/**"), "the steps' work prefixes outlived their commits"


def test_shards_written_in_place_are_checked_against_the_listing_and_nothing_else_stays_beside_them(
        s3: RestartableS3, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """The commit of an artifact whose shards its writers put in place: a shard missing or of another size than
    recorded fails it (no manifest); a shard an earlier attempt left in the folder is removed."""
    import hashlib

    from compass.infra.manifest import FileEntry
    from compass.infra.store import Store
    from tests.test_store import manifest_for

    for key, value in s3.env.items():
        monkeypatch.setenv(key, value)
    store = Store(f"s3://{BUCKET}/in-place", scratch_root=tmp_path)
    manifest = manifest_for(store, "ingest", "web", "e" * 64)
    folder = store.folder_url(manifest.uri, "documents")
    shard = b"a shard's bytes\n" * 100
    store.fs.pipe_file(f"{folder}/00000.jsonl.gz", shard)
    store.fs.pipe_file(f"{folder}/00007.jsonl.gz", b"left by an attempt that read the source in 8 groups")
    recorded = FileEntry(path="documents/00000.jsonl.gz", size=len(shard), sha256=hashlib.sha256(shard).hexdigest())
    with store.staging() as out:
        (out / "stats.json").write_text("{}")
        with pytest.raises(OSError, match=r"documents/00000.jsonl.gz \(1,600 bytes, its writer recorded 1,601\)"):
            store.commit(out, manifest, published=[recorded.model_copy(update={"size": len(shard) + 1})])
        missing = FileEntry(path="documents/00001.jsonl.gz", size=1, sha256="0" * 64)
        with pytest.raises(OSError, match=r"documents/00001.jsonl.gz \(missing"):
            store.commit(out, manifest, published=[recorded, missing])
        assert not store.is_committed(manifest.uri)
        committed = store.commit(out, manifest, published=[recorded])
    assert [e.path for e in committed.files] == ["documents/00000.jsonl.gz", "stats.json"]
    store.fs.invalidate_cache()
    assert store.fs.ls(folder) == [f"{store.path_of(manifest.uri)}/documents/00000.jsonl.gz"]  # the stale one is gone
    from compass.infra import verify

    assert verify.damage(store, manifest.uri, "full") == []
