"""Issue #30, part II, items 4 and 5: a manifest cannot point outside its artifact, a manifest that cannot be read
(truncated, not JSON, another artifact's, in a linked folder) makes its artifact damaged, set aside and recomputed
instead of stopping every run, `compass lineage` reads only the store it started in, and what it prints from
manifests is printed as written."""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from compass.flows import runner
from compass.infra import verify
from compass.infra.errors import DamagedArtifact
from compass.infra.manifest import MANIFEST, InputRef, Manifest
from compass.infra.net import free_port
from compass.infra.store import Store
from compass.tasks.steps.context import StepResult
from tests.s3_server import RestartableS3, s3_on_loopback
from tests.test_store import manifest_for, one_step


def _commit(store: Store, kind: str, name: str, fp: str, files: dict[str, str], **extra) -> Manifest:
    with store.staging() as out:
        for rel, text in files.items():
            (out / rel).parent.mkdir(parents=True, exist_ok=True)
            (out / rel).write_text(text)
        manifest = store.commit(out, manifest_for(store, kind, name, fp, **extra))
    verify.stamp(store, manifest)
    return manifest


def _plant_entry(uri: str, path: str, data: bytes) -> None:
    """Add a file entry to a committed manifest by hand, with the size and sha256 of `data`."""
    manifest = Path(uri) / MANIFEST
    body = json.loads(manifest.read_text())
    body["files"].append({"path": path, "size": len(data), "sha256": hashlib.sha256(data).hexdigest()})
    manifest.write_text(json.dumps(body))


def _step_fn(ctx):
    (ctx.out / "result.txt").write_text("done")
    return StepResult(metrics={"n": 1})


@pytest.mark.parametrize("where", ["dot-dot", "absolute"])
def test_a_manifest_entry_outside_its_artifact_makes_it_damaged(tmp_path: Path, where: str):
    """The entry names a real file outside the artifact with its true size and sha256: a check that followed it
    would find it intact."""
    store = Store(str(tmp_path / "store"))
    m = _commit(store, "tokenize", "web", "a" * 64, {"train/0.tokens": "abc"})
    secret = tmp_path / "secret.txt"
    secret.write_text("the worker's own file")
    path = "../../../secret.txt" if where == "dot-dot" else str(secret)
    assert (Path(m.uri) / path).resolve() == secret
    _plant_entry(m.uri, path, secret.read_bytes())
    problems = verify.damage(store, m.uri, "full")
    assert len(problems) == 1 and "leaves the artifact's folder" in problems[0] and "files.1.path" in problems[0]
    where_to = Path(verify.set_aside(store, m.uri))
    assert not store.is_committed(m.uri) and (where_to / "train" / "0.tokens").is_file() and secret.is_file()


def test_compass_verify_full_reports_an_entry_pointing_out_of_its_artifact(tmp_path: Path):
    store = Store(str(tmp_path / "store"))
    good = _commit(store, "tokenize", "code", "c" * 64, {"train/0.tokens": "def"})
    bad = _commit(store, "tokenize", "web", "a" * 64, {"train/0.tokens": "abc"})
    planted = tmp_path / "planted.txt"
    planted.write_text("outside")
    _plant_entry(bad.uri, "../../../planted.txt", planted.read_bytes())
    done = subprocess.run([sys.executable, "-m", "compass.flows.cli.app", "verify", str(tmp_path / "store"), "--full",
                           "--json"], capture_output=True, text=True, timeout=120)
    report = json.loads(done.stdout)
    assert done.returncode == 1 and report["checked"] == 2 and list(report["damaged"]) == [bad.uri], done.stdout
    assert "leaves the artifact's folder" in report["damaged"][bad.uri][0] and store.is_committed(good.uri)


def test_copy_verified_never_writes_outside_its_destination(tmp_path: Path):
    store = Store(str(tmp_path / "store"))
    m = _commit(store, "tokenize", "web", "a" * 64, {"train/0.tokens": "abc"})
    source = tmp_path / "store" / "planted.txt"  # what <artifact>/../../planted.txt reads
    source.write_text("written where the copy should never write")
    _plant_entry(m.uri, "../../planted.txt", source.read_bytes())
    node = tmp_path / "node"
    with pytest.raises(DamagedArtifact, match="leaves the artifact's folder"):
        store.copy_verified(m.uri, node / "cache")
    assert not (node / "planted.txt").exists() and not (node / "cache").exists()


@pytest.mark.parametrize("damage", ["truncated", "not json", "not utf-8", "a field missing"])
def test_an_unreadable_manifest_is_set_aside_and_its_step_recomputed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                      damage: str):
    ctx, step = one_step(tmp_path, monkeypatch, _step_fn)
    first = runner.run_step(ctx, step, logging.getLogger())
    manifest = Path(first.uri) / MANIFEST
    text = manifest.read_text()
    body = {"truncated": text[: len(text) // 2].encode(), "not json": b"<html>503</html>",
            "not utf-8": b"\xff\xfe{", "a field missing": text.replace('"kind"', '"knd"').encode()}[damage]
    manifest.write_bytes(body)
    problems = verify.damage(ctx.store, first.uri)
    assert len(problems) == 1 and "not a readable manifest" in problems[0], problems
    again = runner.run_step(ctx, step, logging.getLogger())
    assert again.executed and again.manifest.fingerprint == first.manifest.fingerprint
    assert verify.damage(ctx.store, again.uri) == [] and (Path(again.uri) / "result.txt").read_text() == "done"
    (aside,) = (tmp_path / "store" / verify.SET_ASIDE / "slow").iterdir()
    assert (aside / MANIFEST).read_bytes() == body  # kept for inspection


def test_a_damaged_manifest_does_not_stop_the_plan(tmp_path: Path):
    """A cached step's unreadable manifest and an older version's: the plan and its data report still come out
    (the run then sets the cached one aside)."""
    from compass.flows.compiler import compile_spec
    from compass.flows.reports.mixture import source_sizes
    from compass.flows.reports.plan_status import plan_status
    from compass.specs import load_spec
    from tests.conftest import write_minimal_spec

    plan = compile_spec(load_spec(write_minimal_spec(tmp_path)).spec)
    store = Store(str(tmp_path / "store"))
    ingest = Path(store.uri("ingest", "notes", plan.fingerprints["ingest:notes"]))
    older = Path(store.uri("curate", "notes", "0" * 64))
    for folder in (ingest, older):
        folder.mkdir(parents=True)
        (folder / MANIFEST).write_text('{"kind": "ingest", "name": "no')
    statuses = {s.step_id: s for s in plan_status(plan, store)}
    assert statuses["ingest:notes"].state == "run"  # not shown as cached: the run sets it aside and recomputes it
    assert statuses["ingest:notes"].reason.startswith("damaged manifest, set aside when run: manifest.json: not a")
    assert statuses["curate:notes"].state == "run" and statuses["curate:notes"].reason == "new"
    assert store.committed("curate", "notes") == []
    assert source_sizes(plan, list(statuses.values()), store)["notes"].how == "unknown"


def test_scheduled_evaluation_skips_a_damaged_model_manifest(tmp_path: Path):
    """The scheduled evaluation reads manifests through the store's checks: a damaged one is no checkpoint (it
    stopped every scheduled run with a ValidationError traceback when the evaluation parsed manifests itself)."""
    from compass.flows.scheduled_eval import discover
    from compass.infra.layout import WEIGHTS

    store = Store(str(tmp_path / "store"))
    good = _commit(store, "pretrain", "stage1", "a" * 64, {f"final/{WEIGHTS}": "weights"})
    damaged = Path(store.uri("pretrain", "stage2", "b" * 64))
    damaged.mkdir(parents=True)
    (damaged / MANIFEST).write_text('{"kind": "pretrain", "name": "sta')
    assert [(c["artifact"], c["folder"]) for c in discover(store)] == [(good.uri, "final")]


def test_a_linked_artifact_folder_is_damaged_and_its_target_left_alone(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch):
    ctx, step = one_step(tmp_path, monkeypatch, _step_fn)
    store = ctx.store
    other = _commit(store, "slow", "other", "e" * 64, {"result.txt": "another artifact's data"})
    uri = runner.step_uri(ctx, step)
    Path(uri).parent.mkdir(parents=True, exist_ok=True)
    Path(uri).symlink_to(Path(other.uri), target_is_directory=True)
    assert uri in verify.committed(store)  # `compass verify` checks it
    problems = verify.damage(store, uri)
    assert len(problems) == 1 and "is a link to" in problems[0], problems
    again = runner.run_step(ctx, step, logging.getLogger())
    assert again.executed and not Path(uri).is_symlink() and (Path(uri) / "result.txt").read_text() == "done"
    assert store.is_committed(other.uri) and verify.damage(store, other.uri) == []
    assert (Path(other.uri) / "result.txt").read_text() == "another artifact's data"


def test_a_manifest_naming_another_artifact_is_damaged(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    ctx, step = one_step(tmp_path, monkeypatch, _step_fn)
    other = _commit(ctx.store, "slow", "other", "e" * 64, {"result.txt": "another artifact's data"})
    uri = runner.step_uri(ctx, step)
    Path(uri).parent.mkdir(parents=True, exist_ok=True)
    shutil.copytree(other.uri, uri)  # a whole artifact copied under another step's name
    problems = verify.damage(ctx.store, uri)
    assert len(problems) == 1 and "describes another artifact (slow/other-eeeeeeeeeeee)" in problems[0], problems
    again = runner.run_step(ctx, step, logging.getLogger())
    assert again.executed and (Path(uri) / "result.txt").read_text() == "done"


@pytest.fixture
def planted_url() -> Iterator[tuple[str, list[str]]]:
    """A real HTTP server on 127.0.0.1 that records every request: a URL planted in a manifest."""
    hits: list[str] = []

    class Recording(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            hits.append(self.path)
            self.send_response(404)
            self.end_headers()

        do_HEAD = do_GET

        def log_message(self, *args) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", free_port()), Recording)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_port}/ingest/web-eeeeeeeeeeee", hits
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def test_lineage_follows_only_inputs_inside_its_store(tmp_path: Path, planted_url: tuple[str, list[str]]):
    from compass.infra.lineage import lineage

    url, hits = planted_url
    elsewhere = Store(str(tmp_path / "elsewhere"))  # a committed artifact outside the store, reached through '..'
    outside = _commit(elsewhere, "ingest", "web", "e" * 64, {"data.txt": "x"},
                      provenance=[{"kind": "local", "path": "/secret/source"}])
    store = Store(str(tmp_path / "store"))
    through = f"{store.root}/../elsewhere/ingest/web-eeeeeeeeeeee"
    assert Path(through).resolve() == Path(outside.uri)
    inside = _commit(store, "ingest", "code", "d" * 64, {"data.txt": "y"})
    refs = [InputRef(role=role, step="ingest:web", uri=uri, fingerprint="e" * 64)
            for role, uri in (("planted", url), ("through", through))]
    refs.append(InputRef(role="own", step="ingest:code", uri=inside.uri, fingerprint=inside.fingerprint))
    top = _commit(store, "curate", "web", "f" * 64, {"train/0.jsonl": "{}"}, inputs=refs)
    tree = lineage(top.uri)
    planted, reached, own = tree["inputs"]
    assert hits == [] and planted["missing"] and "not followed" in planted["why"]
    assert reached["missing"] and "provenance" not in reached and "not followed" in reached["why"]
    assert own["step"] == "ingest:code" and own["uri"] == inside.uri and "missing" not in own


def test_lineage_prints_a_shared_ancestor_once(tmp_path: Path):
    """Two inputs of one artifact from the same curated source: its ancestry is printed once, then referenced."""
    from typer.testing import CliRunner

    from compass.flows.cli.app import app

    store = Store(str(tmp_path / "store"))
    raw = _commit(store, "ingest", "web", "e" * 64, {"data.txt": "x"}, provenance=[{"kind": "local", "path": "/w"}])
    curated = _commit(store, "curate", "web", "d" * 64, {"train/0.jsonl": "{}"},
                      inputs=[InputRef(role="raw", step="ingest:web", uri=raw.uri, fingerprint=raw.fingerprint)])
    shared = InputRef(role="curated", step="curate:web", uri=curated.uri, fingerprint=curated.fingerprint)
    tokens = [_commit(store, "tokenize", name, c * 64, {"t.bin": "0"}, inputs=[shared]) for name, c in
              (("web", "b"), ("web2", "c"))]
    top = _commit(store, "pretrain", "stage1", "a" * 64, {"w.bin": "0"},
                  inputs=[InputRef(role=f"tokens:{t.name}", step=f"tokenize:{t.name}", uri=t.uri,
                                   fingerprint=t.fingerprint) for t in tokens])
    done = CliRunner().invoke(app, ["lineage", top.uri])
    assert done.exit_code == 0, done.output
    assert done.output.count(raw.uri) == 1 and done.output.count(curated.uri) == 1  # shown in full once
    assert done.output.count("curate:web") == 2 and "dddddddddddd (shown above)" in done.output


def test_lineage_prints_paths_and_names_with_brackets_as_written(tmp_path: Path):
    from typer.testing import CliRunner

    from compass.flows.cli.app import app

    store = Store(str(tmp_path / "a[" / "x]" / "store"))  # '[/x]' in the path: a closing tag to rich
    raw = _commit(store, "ingest", "web", "e" * 64, {"data.txt": "x"},
                  provenance=[{"kind": "pypi", "package": "[bold]pkg[/y]", "version": "1"}])
    ref = InputRef(role="raw", step="ingest:web", uri=raw.uri, fingerprint=raw.fingerprint)
    top = _commit(store, "curate", "web", "f" * 64, {"train/0.jsonl": "{}"}, inputs=[ref])
    done = CliRunner().invoke(app, ["lineage", f"{top.uri}/train/0.jsonl"])
    assert done.exit_code == 0, done.output
    assert top.uri in done.output and raw.uri in done.output and "a[/x]/store" in done.output
    assert "source: pypi [bold]pkg[/y] 1" in done.output


@pytest.fixture(scope="module")
def s3() -> Iterator[RestartableS3]:
    with s3_on_loopback() as server:
        yield server


def test_a_remote_copy_refuses_keys_that_leave_its_prefix(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                          s3: RestartableS3):
    """S3 keys are any strings: 'src/../../../x' or 'src//tmp/x' would be written outside the local copy."""
    from compass.infra.errors import DataError
    from compass.infra.remote import local_copy

    for key, value in s3.env.items():
        monkeypatch.setenv(key, value)
    cache = tmp_path / "c" / "cache"
    monkeypatch.setenv("COMPASS_CACHE", str(cache))
    s3.create_bucket("compass-unsafe-keys")
    client = s3.client()
    escaped, absolute = tmp_path / "c" / "escaped.txt", tmp_path / "absolute.txt"
    for key in ("src/ok.txt", "src/../../../escaped.txt", f"src/{absolute}"):
        client.put_object(Bucket="compass-unsafe-keys", Key=key, Body=b"planted")
    with pytest.raises(DataError, match=r"keys leave the prefix \(\.\./\.\./\.\./escaped\.txt, /.*/absolute\.txt\)"):
        local_copy("s3://compass-unsafe-keys/src")
    assert not escaped.exists() and not absolute.exists()
    assert not any(p.is_file() for p in cache.rglob("*"))  # nothing copied at all
