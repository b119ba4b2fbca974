"""Inside the store (issue 80, item 9): a link planted among the store's own folders (`.damaged`, `.staging`, a
kind's folder) is refused before anything is written or moved through it, and a link among an artifact's files is
damage: what it names can change while the artifact's own files do not."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from compass.infra.errors import RootRefused
from compass.infra.store import Store
from compass.infra.verify import damage, set_aside
from tests.test_store import manifest_for


def committed(store: Store, name: str = "web", fingerprint: str = "a" * 64):
    with store.staging() as out:
        (out / "train").mkdir()
        (out / "train" / "0.jsonl").write_text('{"text": "x"}\n')
        return store.commit(out, manifest_for(store, "curate", name, fingerprint))


def test_a_link_as_the_set_aside_folder_moves_nothing_out_of_the_store(tmp_path: Path):
    store = Store(str(tmp_path / "store"))
    manifest = committed(store)
    outside = tmp_path / "outside"
    outside.mkdir()
    (tmp_path / "store" / ".damaged").symlink_to(outside)
    with pytest.raises(RootRefused, match=r"\.damaged \(damaged artifacts set aside\) is a link to .*outside"):
        set_aside(store, manifest.uri)
    assert list(outside.iterdir()) == [] and store.is_committed(manifest.uri)  # the artifact where it was


def test_a_link_as_the_staging_folder_is_refused_before_a_byte_is_written(tmp_path: Path):
    store = Store(str(tmp_path / "store"))
    committed(store)  # the store exists, .staging with it
    outside = tmp_path / "outside"
    outside.mkdir()
    shutil.rmtree(tmp_path / "store" / ".staging")
    (tmp_path / "store" / ".staging").symlink_to(outside)
    with pytest.raises(RootRefused, match=r"\.staging \(half-written artifacts\) is a link"), store.staging():
        pass
    assert list(outside.iterdir()) == []


def test_a_kinds_folder_that_is_a_link_is_never_committed_into(tmp_path: Path):
    store = Store(str(tmp_path / "store"))
    committed(store)
    outside = tmp_path / "outside"
    outside.mkdir()
    (tmp_path / "store" / "tokenize").symlink_to(outside)
    with store.staging() as out, pytest.raises(RootRefused, match=r"tokenize \(the artifacts of one kind\) is a link"):
        (out / "shard.bin").write_bytes(b"\0" * 8)
        store.commit(out, manifest_for(store, "tokenize", "web", "b" * 64))
    assert list(outside.iterdir()) == []


def test_a_committed_file_replaced_by_a_link_is_damage_even_to_identical_bytes(tmp_path: Path):
    store = Store(str(tmp_path / "store"))
    manifest = committed(store)
    assert damage(store, manifest.uri) == []
    shard = Path(store.path_of(manifest.uri)) / "train" / "0.jsonl"
    copy = tmp_path / "same.jsonl"
    shutil.copy(shard, copy)
    shard.unlink()
    shard.symlink_to(copy)  # the same size and bytes today; whatever the outside file holds tomorrow
    for depth in ("sizes", "stamped", "full"):
        problems = damage(store, manifest.uri, depth)
        assert problems == [f"train/0.jsonl: a link to {copy}, not a file of the artifact"], (depth, problems)
