"""Inside the store (issue 80, item 9): a link planted among the store's own folders (`.damaged`, `.staging`, a
kind's folder) is refused before anything is written or moved through it, and a link among an artifact's files is
damage: what it names can change while the artifact's own files do not. An artifact's manifest must be the one its
folder and its consumer's plan name: two artifacts' folders swapped, or a manifest made for another fingerprint that
shares its folder's 12 characters, is damage, never reused."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from compass.flows.compiler import compile_spec
from compass.infra.errors import RootRefused
from compass.infra.store import Store
from compass.infra.verify import damage, set_aside
from compass.specs.loader import load_spec
from tests.conftest import write_minimal_spec
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


def test_two_artifacts_swapped_between_their_folders_are_damaged_not_reused(tmp_path: Path):
    """The tokens of two sources exchanged, stamps removed: each folder holds a manifest that certifies the other's
    files; neither is read as the other."""
    store = Store(str(tmp_path / "store"))
    made = {}
    for name, fingerprint in (("en", "a" * 64), ("fr", "b" * 64)):
        with store.staging() as out:
            (out / "shard.bin").write_bytes(name.encode() * 64)
            made[name] = store.commit(out, manifest_for(store, "tokenize", name, fingerprint))
    en, fr = (Path(store.path_of(made[n].uri)) for n in ("en", "fr"))
    en.rename(tmp_path / "t")
    fr.rename(en)
    (tmp_path / "t").rename(fr)
    shutil.rmtree(tmp_path / "store" / ".verified", ignore_errors=True)
    for name, other in (("en", "fr"), ("fr", "en")):
        problems = damage(store, made[name].uri, "full", expects=made[name].fingerprint)
        assert problems == [f"{made[name].uri}: its manifest describes another artifact "
                            f"(tokenize/{other}-{made[other].fingerprint[:12]})"]


def test_a_manifest_made_for_another_fingerprint_in_a_folder_of_the_same_prefix_is_never_reused(tmp_path: Path):
    """The folder names 12 characters of the fingerprint; the plan computes all 64: a manifest whose fingerprint
    differs after those 12 is another identity's artifact, damaged for the step that expects its own."""
    from compass.flows.reports.plan_status import plan_status

    plan = compile_spec(load_spec(write_minimal_spec(tmp_path)).spec)
    step = plan.step("ingest:notes")
    expected = plan.fingerprints[step.id]
    forged = expected[:12] + ("0" if expected[12] != "0" else "1") + expected[13:]
    store = Store(str(tmp_path / "store"))
    with store.staging() as out:
        (out / "docs.jsonl").write_text('{"text": "another source"}\n')
        made = store.commit(out, manifest_for(store, "ingest", "notes", forged))
    assert made.uri == store.uri("ingest", "notes", expected)  # the folder the plan looks in
    assert damage(store, made.uri) == []  # intact as a file set: only the identity tells it apart
    assert damage(store, made.uri, expects=forged) == []
    problems = damage(store, made.uri, expects=expected)
    assert len(problems) == 1 and f"made for fingerprint {forged[:24]}" in problems[0], problems
    status = next(s for s in plan_status(plan, store) if s.step_id == step.id)
    assert status.state == "run" and f"made for fingerprint {forged[:24]}" in status.reason, status
