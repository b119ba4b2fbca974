"""Node-local staging (how.storage.local_cache): the trainer copies the tokenized sources from the store into the
node's local folder, verified against their manifests, reads only from there, and reuses a verified copy; from
a local store and from S3 (moto's server on loopback)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from compass.infra.manifest import MANIFEST
from compass.infra.store import Store
from tests.test_remote_data import s3  # noqa: F401 - the S3 server fixture
from tests.test_store import manifest_for
from tests.test_tensor_parallel import final_weights

pytestmark = pytest.mark.slow


def test_training_reads_its_data_from_the_node_local_copy(stage1_job, tmp_path: Path):
    from compass.tasks.common.training import run_training

    nvme = tmp_path / "nvme"
    staged = stage1_job(tmp_path / "staged", local_cache=nvme)
    assert staged.staging is not None and all(p.parent == nvme for p in staged.sources.values())
    assert not nvme.exists()  # nothing copied before the trainer starts (it does, on each node)
    result = run_training(staged, logging.getLogger("test"))
    assert result.setup.data_from == str(nvme)
    copies = sorted(p for p in nvme.iterdir() if not p.name.startswith("."))  # (.locks: one per copy)
    assert len(copies) == len(staged.sources) and all((c / MANIFEST).exists() for c in copies)
    plain = run_training(stage1_job(tmp_path / "plain"), logging.getLogger("test"))
    assert plain.setup.data_from == "store"
    a, b = final_weights(tmp_path / "plain"), final_weights(tmp_path / "staged")
    assert all(bool((a[k] == b[k]).all()) for k in a)  # the same bytes, read from elsewhere

    store, uri = Store(staged.staging.store_root), next(iter(staged.staging.uris.values()))
    copy = store.copy_verified(uri, nvme)
    shard = next(p for p in copy.rglob("*") if p.is_file() and p.name != MANIFEST)
    before = shard.stat().st_mtime_ns
    assert store.copy_verified(uri, nvme) == copy and shard.stat().st_mtime_ns == before  # reused, not copied
    original = shard.read_bytes()
    shard.write_bytes(original[: len(original) // 2])  # evicted half-way, or truncated by a full disk
    assert store.copy_verified(uri, nvme) == copy and shard.read_bytes() == original  # copied again


def test_staging_from_s3_is_verified_against_the_manifest(s3, tmp_path: Path):  # noqa: F811
    store = Store("s3://data/runs")
    with store.staging() as out:
        (out / "train").mkdir()
        (out / "train" / "00000.tokens").write_bytes(bytes(range(256)) * 64)
        (out / "heldout.tokens").write_bytes(b"\x01\x02" * 500)
        manifest = store.commit(out, manifest_for(store, "tokenize", "web", "b" * 64))
    copy = store.copy_verified(manifest.uri, tmp_path / "node1")
    assert (copy / "train" / "00000.tokens").read_bytes() == bytes(range(256)) * 64
    assert (copy / MANIFEST).exists()
    # the store's object replaced with other bytes of the same size: a fresh node refuses it
    s3.client().put_object(Bucket="data", Key=f"runs/tokenize/web-{'b' * 12}/heldout.tokens", Body=b"\x03\x04" * 500)
    with pytest.raises(OSError, match=r"checksum mismatch for .*heldout.tokens"):
        store.copy_verified(manifest.uri, tmp_path / "node2")
    left = [p for p in (tmp_path / "node2").iterdir() if not p.name.startswith(".")]
    # no copy is left to be taken as staged: the partial copy keeps only what it verified, for a retry to resume
    assert [p.name for p in left] == [copy.name + ".part"] and not (left[0] / MANIFEST).exists()
    assert not (left[0] / "heldout.tokens").exists()
