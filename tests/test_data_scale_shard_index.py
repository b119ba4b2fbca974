"""Shard sets: a folder of more than how.storage.shard_index_above files is listed in a sidecar index that the
manifest names with its count, bytes and sha256 (a manifest stays small at a million shards); every check still
compares each file's size, hashes a sample (all under `full`), and refuses an index that is not the committed one.
Locally, on S3 (moto's server on loopback), and through real data steps, node-local staging and training."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from compass.infra.manifest import MANIFEST
from compass.infra.shard_index import INDEX_SUFFIX
from compass.infra.store import Store
from compass.infra.verify import damage
from tests.conftest import run_up_to, write_minimal_spec
from tests.test_remote_data import s3  # noqa: F401 - the S3 server fixture
from tests.test_store import manifest_for

SHARDS = 40


def commit_shards(store: Store, index_above: int = 10):
    with store.staging() as out:
        (out / "train").mkdir()
        for i in range(SHARDS):
            (out / "train" / f"{i:05d}.tokens").write_bytes(bytes([i]) * (100 + i))
        (out / "heldout").mkdir()
        (out / "heldout" / "00000.tokens").write_bytes(b"\x07" * 50)
        (out / "meta.json").write_text("{}")
        return store.commit(out, manifest_for(store, "tokenize", "web", "c" * 64), index_above)


def test_a_large_folder_is_committed_as_a_shard_set_and_checked_through_its_index(tmp_path: Path):
    store = Store(str(tmp_path / "store"))
    manifest = commit_shards(store)
    assert [f.path for f in manifest.files] == ["heldout/00000.tokens", "meta.json", f"train{INDEX_SUFFIX}"]
    (shards,) = manifest.shard_sets
    assert (shards.folder, shards.count, shards.bytes) == ("train", SHARDS, sum(100 + i for i in range(SHARDS)))
    assert manifest.file_count == SHARDS + 3
    folder = Path(store.local_path(manifest.uri))
    assert "train/00001.tokens" not in (folder / MANIFEST).read_text()  # the manifest does not list the shards
    train = store.entries(store.read_manifest(manifest.uri), "train")
    assert [e.path for e in train] == [f"train/{i:05d}.tokens" for i in range(SHARDS)]
    assert damage(store, manifest.uri) == [] and damage(store, manifest.uri, "full") == []

    shard = folder / "train" / "00007.tokens"
    original = shard.read_bytes()
    shard.write_bytes(original[:-1])  # truncated: sizes are always compared, whatever the sample
    assert damage(store, manifest.uri, "sizes") == ["train/00007.tokens: 106 bytes, committed with 107"]
    shard.write_bytes(b"\xff" * len(original))  # same size, other bytes: the full check hashes every shard
    assert damage(store, manifest.uri, "full") == ["train/00007.tokens: contents changed since the commit "
                                                   "(sha256 differs)"]
    assert damage(store, manifest.uri, "sizes") == []
    shard.write_bytes(original)
    (folder / "train" / "99999.tokens").write_bytes(b"x")
    assert damage(store, manifest.uri) == ["train/99999.tokens: not part of the committed artifact"]
    (folder / "train" / "99999.tokens").unlink()

    index = folder / f"train{INDEX_SUFFIX}"
    lines = index.read_text().splitlines()
    index.write_text("\n".join(lines[:-1]) + "\n")  # a shard dropped from the index
    problems = damage(store, manifest.uri)
    assert len(problems) == 1 and "the shard index differs from the one its manifest names" in problems[0]


def test_a_sampled_check_finds_a_changed_shard_once_it_is_drawn(tmp_path: Path):
    store = Store(str(tmp_path / "store"))
    manifest = commit_shards(store)
    folder = Path(store.local_path(manifest.uri))
    for shard in (folder / "train").iterdir():  # every shard rewritten with other bytes of its size
        shard.write_bytes(b"\xfe" * shard.stat().st_size)
    problems = damage(store, manifest.uri)  # 32 of 40 drawn
    assert len(problems) == 32 and all("sha256 differs" in p for p in problems)


def _every_shard_drawn(monkeypatch: pytest.MonkeyPatch) -> None:
    from compass.infra import verify

    monkeypatch.setattr(verify.shard_index, "sample", lambda members, k=32: {e.path for e in members})


def test_a_shard_set_unchanged_since_it_was_wholly_hashed_is_only_listed(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch):
    """GB-sized shards: a step's check of its inputs must not read 32 of them each time. The commit stamps one
    digest of the set's (path, size, mtime, inode); while it holds, a `stamped` check hashes no shard."""
    from compass.infra import verify

    store = Store(str(tmp_path / "store"))
    manifest = commit_shards(store)
    verify.stamp(store, manifest)  # as every step's commit does
    hashed: list[str] = []
    real = verify.sha256_file
    monkeypatch.setattr(verify, "sha256_file", lambda path: hashed.append(path) or real(path))
    _every_shard_drawn(monkeypatch)
    assert damage(store, manifest.uri) == [] and not [p for p in hashed if "/train/" in p]

    shard = Path(store.local_path(manifest.uri)) / "train" / "00003.tokens"
    original = shard.read_bytes()
    shard.write_bytes(b"\xfe" * len(original))  # same size: only its stamp key tells
    assert damage(store, manifest.uri) == ["train/00003.tokens: contents changed since the commit (sha256 differs)"]
    shard.write_bytes(original)
    hashed.clear()
    assert damage(store, manifest.uri) == [] and len([p for p in hashed if "/train/" in p]) == SHARDS
    hashed.clear()
    assert damage(store, manifest.uri) == [] and hashed, "a sampled check must not bless the shards it did not hash"
    assert damage(store, manifest.uri, "full") == []  # every shard hashed: the set is stamped again
    hashed.clear()
    assert damage(store, manifest.uri) == [] and not [p for p in hashed if "/train/" in p]


def test_a_shard_set_on_s3_is_checked_and_staged_through_its_index(s3, tmp_path: Path,  # noqa: F811
                                                                    monkeypatch: pytest.MonkeyPatch):
    store = Store("s3://data/runs")
    manifest = commit_shards(store)
    assert damage(store, manifest.uri, "full") == []
    copy = store.copy_verified(manifest.uri, tmp_path / "node", only="train")  # node-local staging of one folder
    assert sorted(p.name for p in (copy / "train").iterdir()) == [f"{i:05d}.tokens" for i in range(SHARDS)]
    assert not (copy / "heldout").exists()
    from compass.infra import verify

    verify.stamp(store, manifest)
    streamed: list[str] = []
    real = verify._streams_intact
    monkeypatch.setattr(verify, "_streams_intact", lambda st, uri, e: streamed.append(e.path) or real(st, uri, e))
    _every_shard_drawn(monkeypatch)
    assert damage(store, manifest.uri) == [] and not [p for p in streamed if p.startswith("train/")]  # ETags hold
    key = f"runs/tokenize/web-{'c' * 12}/train/00003.tokens"
    s3.client().put_object(Bucket="data", Key=key, Body=b"\x00" * 103)  # same size, other bytes
    assert damage(store, manifest.uri) == ["train/00003.tokens: contents changed since the commit "
                                           "(sha256 differs)"]  # its ETag changed: the set is sampled
    assert damage(store, manifest.uri, "full") == ["train/00003.tokens: contents changed since the commit "
                                                   "(sha256 differs)"]
    with pytest.raises(OSError, match=r"checksum mismatch for .*train/00003.tokens"):
        store.copy_verified(manifest.uri, tmp_path / "node2", only="train")


@pytest.mark.slow
def test_data_steps_commit_shard_sets_that_curation_tokenization_and_training_read(tmp_path: Path):
    """The minimal spec with shard sets above 1 file: curate reads ingest's documents, tokenize the curated
    splits and the trainer the token shards (staged node-locally) through the indexes."""
    spec = write_minimal_spec(tmp_path, **{"how:\n": f"how:\n  storage: {{root: {tmp_path / 'store'}, "
                                                     f"shard_index_above: 1, local_cache: {tmp_path / 'nvme'}}}\n"})
    plan, outcomes = run_up_to(spec, "pretrain:stage1", tmp_path / "store")
    store = Store(str(tmp_path / "store"))
    sets = {}
    for step in plan.steps:
        manifest = store.read_manifest(store.uri(step.kind, step.name, plan.fingerprints[step.id]))
        sets[step.id] = {s.folder: s.count for s in manifest.shard_sets}
        assert damage(store, manifest.uri, "full") == [], step.id
    assert set(sets["tokenize:notes"]) == {"train", "heldout"} and sets["tokenize:notes"]["train"] > 1
    assert set(sets["curate:notes"]) >= {"train"}
    trained = store.read_manifest(store.uri("pretrain", "stage1", plan.fingerprints["pretrain:stage1"]))
    assert trained.metrics["tokens"] > 0
    staged = [json.loads(p.read_text()) for p in (tmp_path / "nvme").glob(f"*/{MANIFEST}")]
    assert {m["name"] for m in staged} == {"notes", "code"}  # the token sources copied to the node first

    tokens = Path(store.local_path(store.uri("tokenize", "notes", plan.fingerprints["tokenize:notes"])))
    shard = sorted((tokens / "train").glob("*.tokens"))[-1]
    shard.write_bytes(shard.read_bytes()[:-2])  # truncated after its commit
    verify = [sys.executable, "-m", "compass.flows.cli.app", "verify", str(tmp_path / "store"), "--full", "--json"]
    done = subprocess.run(verify, capture_output=True, text=True, timeout=300)
    assert done.returncode == 1, done.stderr[-2000:]
    (problems,) = json.loads(done.stdout)["damaged"].values()
    assert problems == [f"train/{shard.name}: {shard.stat().st_size:,} bytes, committed with "
                        f"{shard.stat().st_size + 2:,}"]
