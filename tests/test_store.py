"""The artifact store: atomic commits (manifest last), checksums, locks with heartbeats, lineage."""

from __future__ import annotations

import json
import logging
import threading
import time
from pathlib import Path

import pytest

from compass.flows import runner
from compass.flows.compiler import Plan
from compass.infra.fingerprint import fingerprint, sha256_file
from compass.infra.lineage import LineageError, lineage
from compass.infra.locks import StepLock
from compass.infra.manifest import MANIFEST, Manifest
from compass.infra.store import Store
from compass.tasks.steps import registry
from compass.tasks.steps.context import Runtime, StepResult
from compass.tasks.steps.kind import Step, StepKind
from compass.tasks.steps.step_config import StepConfig


class SlowConfig(StepConfig):
    label: str


def manifest_for(store: Store, kind: str, name: str, fp: str, **extra) -> Manifest:
    return Manifest(kind=kind, name=name, fingerprint=fp, uri=store.uri(kind, name, fp), config={},
                    spec_hash="s", spec_name="t", code_version="c", phase_version="1", libraries={}, host="h",
                    python="3", started_at=1.0, finished_at=2.0, **extra)


def test_commit_is_atomic_and_records_checksums(tmp_path: Path):
    store = Store(str(tmp_path / "store"))
    fp = "a" * 64
    m = manifest_for(store, "curate", "web", fp)
    with store.staging() as out:
        (out / "train").mkdir()
        (out / "train" / "0.jsonl").write_text('{"text": "x"}\n')
        assert not store.is_committed(m.uri)
        committed = store.commit(out, m)
    assert store.is_committed(m.uri)
    folder = Path(m.uri)
    entry = committed.files[0]
    assert entry.path == "train/0.jsonl" and entry.sha256 == sha256_file(str(folder / "train/0.jsonl"))
    assert json.loads((folder / MANIFEST).read_text())["fingerprint"] == fp
    assert not list((tmp_path / "store" / ".staging").iterdir())  # staging cleaned up


def test_half_written_artifact_is_not_committed_and_is_replaced(tmp_path: Path):
    store = Store(str(tmp_path / "store"))
    m = manifest_for(store, "curate", "web", "b" * 64)
    leftover = Path(m.uri)
    leftover.mkdir(parents=True)
    (leftover / "partial.bin").write_bytes(b"crashed mid-write")
    assert not store.is_committed(m.uri)
    with store.staging() as out:
        (out / "good.txt").write_text("complete")
        store.commit(out, m)
    assert sorted(p.name for p in leftover.iterdir()) == ["good.txt", MANIFEST]


def test_committed_versions_match_name_exactly(tmp_path: Path):
    store = Store(str(tmp_path / "store"))
    for name, fp in (("web", "c" * 64), ("web_fr", "d" * 64)):
        with store.staging() as out:
            store.commit(out, manifest_for(store, "curate", name, fp))
    assert [m.name for m in store.committed("curate", "web")] == ["web"]


def test_lock_excludes_a_second_holder_and_stale_locks_are_taken_over(tmp_path: Path):
    store = Store(str(tmp_path / "store"))
    first = StepLock(store, "curate/web-1", heartbeat_s=0.2, stale_after_s=2)
    assert first.acquire(timeout_s=1)
    second = StepLock(store, "curate/web-1", heartbeat_s=0.2, stale_after_s=2)
    with pytest.raises(TimeoutError):
        second.acquire(timeout_s=1.0)  # the heartbeat keeps the first lock fresh
    first.release()
    assert second.acquire(timeout_s=1)
    second.release()
    # a lock left by a dead process (no heartbeat for longer than stale_after_s) is taken over
    dead = Path(store.root_path) / ".locks" / "curate" / "web-2.lock"
    dead.parent.mkdir(parents=True, exist_ok=True)
    dead.write_text(json.dumps({"token": "dead", "host": "h", "pid": 1, "heartbeat": time.time() - 60}))
    third = StepLock(store, "curate/web-2", stale_after_s=2)
    assert third.acquire(timeout_s=2)
    third.release()


def test_a_lock_of_a_killed_process_on_this_machine_is_taken_at_once(tmp_path: Path):
    """kill -9 leaves a lock with a fresh heartbeat: the next run must not sit out the stale timeout."""
    import subprocess
    import sys

    store = Store(str(tmp_path / "store"))
    holder = subprocess.Popen([sys.executable, "-c", f"""
import time
from compass.infra.locks import StepLock
from compass.infra.store import Store
assert StepLock(Store({str(tmp_path / 'store')!r}), "curate/web-3").acquire(timeout_s=5)
print("held", flush=True)
time.sleep(600)
"""], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    waits: list[dict] = []
    alive = StepLock(store, "curate/web-3", stale_after_s=600, on_wait=waits.append)
    with pytest.raises(TimeoutError):
        alive.acquire(timeout_s=0.5)  # a live holder is waited for, and said so
    assert waits and waits[0]["pid"] == holder.pid
    holder.kill()
    holder.wait()
    fresh = StepLock(store, "curate/web-3", stale_after_s=600)
    assert fresh.acquire(timeout_s=2)  # the heartbeat is seconds old, but its process is gone
    fresh.release()


def one_step(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fn) -> tuple[runner.RunContext, Step]:
    """A plan of one step of a kind registered for the test, and a run context on a local store."""
    monkeypatch.setattr(registry, "_registered", [StepKind("slow", SlowConfig, fn, None, version="1")])
    step = Step("slow", "web", SlowConfig(label="x"))
    plan = Plan("t", [step], {step.id: fingerprint("slow", step.config.identity(), {}, "1")})
    return runner.RunContext(plan, Store(str(tmp_path / "store")), "hash", Runtime()), step


def test_two_runs_compute_one_step_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    calls = []

    def slow_step(ctx):
        calls.append(ctx.name)
        time.sleep(1.5)
        (ctx.out / "result.txt").write_text("done")
        return StepResult(metrics={"n": 1})

    ctx, step = one_step(tmp_path, monkeypatch, slow_step)
    outcomes = []
    threads = [threading.Thread(target=lambda: outcomes.append(runner.run_step(ctx, step, logging.getLogger())))
               for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert calls == ["web"]
    assert sorted(o.executed for o in outcomes) == [False, True]
    assert len({o.uri for o in outcomes}) == 1


def test_lineage_walks_manifests_to_the_source(tmp_path: Path):
    store = Store(str(tmp_path / "store"))
    raw = manifest_for(store, "ingest", "web", "e" * 64, provenance=[{"kind": "pypi", "package": "p"}])
    with store.staging() as out:
        store.commit(out, raw)
    from compass.infra.manifest import InputRef

    cur = manifest_for(store, "curate", "web", "f" * 64,
                       inputs=[InputRef(role="raw", step="ingest:web", uri=raw.uri, fingerprint=raw.fingerprint)])
    with store.staging() as out:
        (out / "train").mkdir()
        (out / "train" / "0.jsonl").write_text("{}")
        store.commit(out, cur)
    tree = lineage(f"{cur.uri}/train/0.jsonl")
    assert tree["step"] == "curate:web"
    assert tree["inputs"][0]["step"] == "ingest:web"
    assert tree["inputs"][0]["provenance"] == [{"kind": "pypi", "package": "p"}]
    with pytest.raises(LineageError):
        lineage(str(tmp_path / "nowhere"))

    moved = tmp_path / "elsewhere" / "store"  # a store copied to another path keeps its lineage and its cache
    moved.parent.mkdir()
    (tmp_path / "store").rename(moved)
    there = Store(str(moved))
    uri = there.uri("curate", "web", "f" * 64)
    tree = lineage(f"{uri}/train/0.jsonl")
    assert tree["uri"] == uri and tree["inputs"][0]["uri"] == there.uri("ingest", "web", "e" * 64)
    assert there.read_manifest(uri).inputs[0].uri.startswith(str(moved))
    assert there.committed("curate", "web")[0].uri == uri


def test_a_sibling_folder_with_the_store_as_prefix_is_not_inside_it(tmp_path: Path):
    store = Store(str(tmp_path / "store"))
    assert store.is_committed(store.uri("curate", "web", "a" * 64)) is False
    with pytest.raises(ValueError, match="is not inside the store"):
        store.is_committed(str(tmp_path / "store-old" / "curate" / "web-aaaa"))


def _commit(store: Store, name: str, files: dict[str, str]) -> Manifest:
    from compass.infra import verify

    with store.staging() as out:
        for rel, text in files.items():
            (out / rel).parent.mkdir(parents=True, exist_ok=True)
            (out / rel).write_text(text)
        manifest = store.commit(out, manifest_for(store, "tokenize", name, name[0] * 64))
    verify.stamp(store, manifest)
    return manifest


@pytest.mark.parametrize("how", ["flip a byte", "truncate", "replace with other data", "add a shard", "delete"])
def test_an_altered_artifact_is_damaged_and_set_aside(tmp_path: Path, how: str):
    import os

    from compass.infra import verify

    store = Store(str(tmp_path / "store"))
    m = _commit(store, "web", {"train/0.tokens": "abcdef" * 100, "train/1.tokens": "ghijkl" * 100})
    assert verify.damage(store, m.uri) == []
    shard = Path(m.uri) / "train" / "0.tokens"
    if how == "flip a byte":  # same size; the mtime moves on as any write moves it (here at least by 1 ns)
        data = bytearray(shard.read_bytes())
        data[10] ^= 1
        stat = shard.stat()
        shard.write_bytes(bytes(data))
        os.utime(shard, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1))
    elif how == "truncate":
        shard.write_text("abc")
    elif how == "replace with other data":
        shard.write_text("zyxwvu" * 100)
    elif how == "add a shard":
        (shard.parent / "2.tokens").write_text("more")
    else:
        shard.unlink()
    problems = verify.damage(store, m.uri)
    why = {"flip a byte": "contents changed", "truncate": "3 bytes, committed with 600", "delete": "missing",
           "replace with other data": "contents changed", "add a shard": "2.tokens: not part of the committed"}[how]
    assert len(problems) == 1 and why in problems[0], problems
    where = Path(verify.set_aside(store, m.uri))
    assert not store.is_committed(m.uri) and (where / "train").is_dir()  # kept for inspection, no longer cached


def test_a_damaged_cached_step_runs_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    calls = []

    def step_fn(ctx):
        calls.append(ctx.name)
        (ctx.out / "result.txt").write_text("done")
        return StepResult(metrics={"n": 1})

    ctx, step = one_step(tmp_path, monkeypatch, step_fn)
    first = runner.run_step(ctx, step, logging.getLogger())
    assert not runner.run_step(ctx, step, logging.getLogger()).executed  # intact: cached, nothing hashed again
    (Path(first.uri) / "result.txt").write_text("tampered")
    again = runner.run_step(ctx, step, logging.getLogger())
    assert again.executed and calls == ["web", "web"]
    assert (Path(again.uri) / "result.txt").read_text() == "done"


def test_staging_left_by_a_killed_process_is_swept(tmp_path: Path):
    """A dead owner's staging goes; so does one whose PID a later process reuses (32768 PIDs wrap on a busy
    machine); a live owner's and another machine's stay."""
    import os
    import socket
    import subprocess
    import sys
    import time

    store = Store(str(tmp_path / "store"))
    staging = tmp_path / "store" / ".staging"
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    host = socket.gethostname()
    left = staging / f"step-{dead.stdout.strip()}@{host}-abc123"
    mine = staging / f"step-{os.getpid()}@{host}-def456"  # this process: alive
    other = staging / f"step-{dead.stdout.strip()}@another-node-ghi789"  # another machine's: not ours to judge
    later = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])  # a PID the killed run had
    reused = staging / f"step-{later.pid}@{host}-jkl012"
    for folder in (left, mine, other, reused):
        (folder / "train").mkdir(parents=True)
    hour_ago = time.time() - 3600
    os.utime(reused, (hour_ago, hour_ago))  # made an hour before the process now holding its PID started
    try:
        with store.staging() as out:
            assert out.parent == staging
    finally:
        later.kill()
        later.wait()
    assert not left.exists() and mine.exists() and other.exists() and not reused.exists()


def test_compass_verify_checks_a_whole_store(tmp_path: Path):
    import subprocess
    import sys

    store = Store(str(tmp_path / "store"))
    good = _commit(store, "web", {"train/0.tokens": "abc" * 10})
    bad = _commit(store, "code", {"train/0.tokens": "def" * 10})
    assert good.uri != bad.uri
    (Path(bad.uri) / "train" / "0.tokens").write_text("truncated")
    command = [sys.executable, "-m", "compass.flows.cli.app", "verify", str(tmp_path / "store"), "--json"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    report = json.loads(done.stdout)
    assert done.returncode == 1 and report["checked"] == 2 and list(report["damaged"]) == [bad.uri]
    done = subprocess.run([*command, "--set-aside"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and not store.is_committed(bad.uri) and store.is_committed(good.uri)
    assert subprocess.run(command, capture_output=True, timeout=120).returncode == 0  # what is left is intact


def test_verification_depth_decides_what_is_hashed(tmp_path: Path):
    """A same-size edit that restores the mtime escapes the stamped check (as it escapes git's index) and is
    caught by a full check; a sizes-only check catches a truncation but not a same-size edit."""
    import os

    from compass.infra import verify

    store = Store(str(tmp_path / "store"))
    m = _commit(store, "web", {"train/0.tokens": "abcdef" * 100})
    shard = Path(m.uri) / "train" / "0.tokens"
    stat = shard.stat()
    shard.write_text("ABCDEF" * 100)
    os.utime(shard, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert verify.damage(store, m.uri, "stamped") == [] and verify.damage(store, m.uri, "sizes") == []
    assert "contents changed" in verify.damage(store, m.uri, "full")[0]
    shard.write_text("abc")
    assert "3 bytes, committed with 600" in verify.damage(store, m.uri, "sizes")[0]


def test_no_recompute_stops_at_a_damaged_cache_and_leaves_it_in_place(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch):
    from compass.infra.errors import DamagedArtifact
    from compass.specs.how import How, Storage

    def step_fn(ctx):
        (ctx.out / "result.txt").write_text("done")
        return StepResult(metrics={"n": 1})

    ctx, step = one_step(tmp_path, monkeypatch, step_fn)
    first = runner.run_step(ctx, step, logging.getLogger())
    (Path(first.uri) / "result.txt").write_text("tampered")
    stop = runner.RunContext(ctx.plan, ctx.store, ctx.spec_hash,
                             Runtime(how=How(storage=Storage(on_damage="stop"))))
    with pytest.raises(DamagedArtifact, match=r"result.txt: 8 bytes, committed with 4.*--no-recompute"):
        runner.run_step(stop, step, logging.getLogger())
    assert ctx.store.is_committed(first.uri)  # nothing moved: the user inspects it first


def test_a_step_whose_input_was_altered_fails_naming_it_and_the_input_is_set_aside(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    from compass.infra.errors import DamagedArtifact

    def step_fn(ctx):
        (ctx.out / "result.txt").write_text(f"made from {sorted(ctx.inputs)}")
        return StepResult(metrics={"n": 1})

    ctx, first = one_step(tmp_path, monkeypatch, step_fn)
    second = Step("slow", "code", SlowConfig(label="y"), inputs={"raw": first.id})
    fingerprints = {**ctx.plan.fingerprints,
                    second.id: fingerprint("slow", second.config.identity(), {"raw": ctx.plan.fingerprints[first.id]},
                                           "1")}
    two = runner.RunContext(Plan("t", [first, second], fingerprints), ctx.store, "hash", Runtime())
    made = runner.run_step(two, first, logging.getLogger())
    (Path(made.uri) / "result.txt").write_text("swapped")
    with pytest.raises(DamagedArtifact, match=r"its input slow:web at .* was altered.*set aside at"):
        runner.run_step(two, second, logging.getLogger())
    assert not ctx.store.is_committed(made.uri)  # the next run recomputes it


def test_a_remote_stores_local_work_folders_are_its_own(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    """Seen with two smoke runs of one spec at once, each against its own S3 server: both kept the step's local work
    folder (datatrove's completion markers, written-file records) in the machine's cache under the step's
    fingerprint alone, so one run skipped stages the other had done and committed files its own bucket lacked. The
    folder is keyed by the store too: its root and its S3 endpoint."""
    monkeypatch.setenv("COMPASS_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9001")
    first = Store("s3://runs/smoke").work_dir("curate", "web", "f" * 64)
    assert first == Store("s3://runs/smoke").work_dir("curate", "web", "f" * 64)  # a retry finds its attempt's work
    assert first.is_relative_to(tmp_path / "cache" / "work") and first.name == "web-" + "f" * 12
    assert Store("s3://runs/other").work_dir("curate", "web", "f" * 64) != first
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9002")
    assert Store("s3://runs/smoke").work_dir("curate", "web", "f" * 64) != first  # the same bucket, another server
    local = Store(str(tmp_path / "store"))
    assert local.work_dir("curate", "web", "f" * 64) == tmp_path / "store" / ".work" / "curate" / ("web-" + "f" * 12)
