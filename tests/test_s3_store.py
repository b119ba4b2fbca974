"""The store on a real S3-compatible server (moto's, on 127.0.0.1) under faults: a killed run resumes from
checkpoints mirrored to S3, and the server dying mid-upload loses nothing committed. (The full demo on S3,
its cached re-run and lineage from s3:// manifests: tests/test_production.py.)"""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import VENV_BIN, Cli, seeded_s3, write_minimal_spec
from tests.s3_server import KEY_ID, SECRET, RestartableS3, s3_on_loopback

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def s3() -> Iterator[RestartableS3]:
    with s3_on_loopback() as server:
        yield server


def test_training_resumes_from_checkpoints_mirrored_to_s3(server_cli: Cli, data_store: Path, tmp_path: Path,
                                                         s3: RestartableS3):
    """Kill -9 `compass run` mid-stage, lose the machine's local work folder, run again: the step resumes
    from the checkpoint mirrored to S3 in the background, and the export keep_last pruned before its evaluation
    (mirrored too) is still in the artifact."""
    import os
    import signal

    import s3fs

    server_cli.env.update(s3.env | {"COMPASS_CACHE": str(tmp_path / "machine-cache")})
    s3.create_bucket("compass-resume")
    spec = write_minimal_spec(tmp_path, **{
        "name: minimal": "name: minimal-resume",
        "tokens: 20000, sequence_length: 64": "tokens: 150000, sequence_length: 64",
        "parallelism: {micro_batch_size: 2}": "parallelism: {micro_batch_size: 2}\n"
                                              "  checkpoints: {every_steps: 100, keep_last: 1}"})
    root = "s3://compass-resume/runs"
    fs = s3fs.S3FileSystem(key=KEY_ID, secret=SECRET, client_kwargs={"endpoint_url": s3.url})
    seeded_s3(fs, root, data_store)  # the data steps committed: the run is the stage that is killed
    proc = subprocess.Popen([str(VENV_BIN / "compass"), "run", str(spec), "--store", root], cwd=tmp_path,
                            env=server_cli.env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    deadline = time.monotonic() + 600
    work = "compass-resume/runs/.work/pretrain/stage1-*"

    def mirrored(folder: str) -> set[int]:
        found = fs.glob(f"{work}/{folder}/step-*/checksums.json")
        return {int(p.rsplit("/", 2)[-2].removeprefix("step-")) for p in found}

    def killable() -> bool:
        """A checkpoint at step 200 or later mirrored, with the exports keep_last pruned before it (100, ...)."""
        newest = max(mirrored("checkpoints"), default=0)
        return newest >= 200 and set(range(100, newest, 100)) <= mirrored("evaluation-pending")

    while not killable():
        fs.invalidate_cache()  # s3fs caches listings; we are watching another process's writes
        assert proc.poll() is None and time.monotonic() < deadline, "the run ended before a checkpoint was mirrored"
        time.sleep(0.5)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    import shutil

    shutil.rmtree(tmp_path / "machine-cache" / "work")  # a fresh machine: nothing local survives

    summary = server_cli.json("run", str(spec), "--store", root)
    stage1 = next(s for s in summary["steps"] if s["step"] == "pretrain:stage1")
    assert stage1["executed"]
    manifest = json.loads(fs.cat(f"{stage1['uri'].removeprefix('s3://')}/manifest.json"))
    assert manifest["metrics"]["resumed_from"] >= 200
    assert manifest["metrics"]["exports"][0] == "step-00000100"  # pruned, lost with the machine, recovered
    assert manifest["metrics"]["exports"] == [f"step-{s:08d}" for s in (*range(100, 585, 100), 585)]
    fs.invalidate_cache()
    assert not fs.glob("compass-resume/runs/.work/pretrain/stage1-*/checkpoints/*")  # cleared after commit


def verified(fs, manifest_path: str) -> dict:
    """A committed artifact read back whole: every file its manifest lists, with the sha256 it records."""
    import hashlib

    manifest = json.loads(fs.cat(manifest_path))
    folder = manifest_path.rsplit("/", 1)[0]
    for entry in manifest["files"]:
        assert hashlib.sha256(fs.cat(f"{folder}/{entry['path']}")).hexdigest() == entry["sha256"], entry["path"]
    return manifest


def test_s3_outage_mid_upload_loses_nothing_committed(server_cli: Cli, data_store: Path, tmp_path: Path,
                                                      s3: RestartableS3):
    """The S3 server dies in the middle of a checkpoint upload and comes back: what was committed before is
    intact, the interrupted artifact is never visible half-written, and a re-run finishes only what was left."""
    import s3fs

    server_cli.env.update(s3.env)
    s3.create_bucket("compass-outage")
    spec = write_minimal_spec(tmp_path, **{"name: minimal": "name: minimal-outage"})
    root = "s3://compass-outage/runs"
    fs = s3fs.S3FileSystem(key=KEY_ID, secret=SECRET, client_kwargs={"endpoint_url": s3.url})
    data_kinds = ["--until", "ingest", "--until", "curate", "--until", "tokenizer", "--until", "tokenize"]
    seeded_s3(fs, root, data_store)  # committed before the outage, then checked by a run
    assert not [s for s in server_cli.json("run", str(spec), "--store", root, *data_kinds)["steps"] if s["executed"]]
    before = {path: verified(fs, path) for path in fs.glob("compass-outage/runs/*/*/manifest.json")}
    assert len(before) == 7

    s3.arm("/runs/pretrain/stage1-")  # the first PUT of stage1's committed files hangs, then the server dies
    proc = subprocess.Popen([str(VENV_BIN / "compass"), "run", str(spec), "--store", root, "--json"],
                            cwd=tmp_path, env=server_cli.env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    try:
        assert s3.hit.wait(600), "stage1 never started uploading"
        s3.stop()
        time.sleep(3)  # clients retrying now get 'connection refused'
        s3.start()
        proc.wait(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
    fs.invalidate_cache()
    for path, manifest in before.items():
        assert verified(fs, path) == manifest
    for path in fs.glob("compass-outage/runs/pretrain/*/manifest.json"):
        verified(fs, path)  # committed despite the outage (retries): then whole

    final = server_cli.json("run", str(spec), "--store", root)
    assert {s["step"] for s in final["steps"] if s["executed"]} <= {"pretrain:stage1", "pretrain:stage2"}
    fs.invalidate_cache()
    committed = {p: verified(fs, p) for p in fs.glob("compass-outage/runs/*/*/manifest.json")}
    assert {f"{m['kind']}:{m['name']}" for m in committed.values()} >= {"pretrain:stage1", "pretrain:stage2"}
    assert all(committed[path] == manifest for path, manifest in before.items())


def test_credentials_from_a_prefect_secret_block(server_cli: Cli, prefect_server: str, tmp_path: Path,
                                                 s3: RestartableS3):
    """A worker with no S3 credentials in its environment gets them from the spec's Secret block; they reach
    neither manifests nor logs. Without the block, the run fails on the store, not silently elsewhere."""
    import s3fs
    from prefect.blocks.system import Secret
    from prefect.settings import PREFECT_API_URL, temporary_settings

    s3.create_bucket("compass-block")
    with temporary_settings(updates={PREFECT_API_URL: prefect_server}):
        Secret(value={"aws_access_key_id": KEY_ID, "aws_secret_access_key": SECRET, "endpoint_url": s3.url,
                      "region_name": "us-east-1"}).save("compass-test-s3", overwrite=True)
    for key in [k for k in server_cli.env if k.startswith("AWS_")]:  # a worker with no credentials of its own
        del server_cli.env[key]
    server_cli.env["AWS_EC2_METADATA_DISABLED"] = "true"
    storage = "how:\n  storage: {root: s3://compass-block/runs, credentials_block: compass-test-s3}\n"
    spec = write_minimal_spec(tmp_path, **{"name: minimal": "name: minimal-block", "how:\n": storage})
    done = server_cli.json("run", str(spec), "--until", "ingest", "--until", "curate")
    assert len(done["steps"]) == 4 and all(s["uri"].startswith("s3://compass-block/runs/") for s in done["steps"])
    fs = s3fs.S3FileSystem(key=KEY_ID, secret=SECRET, client_kwargs={"endpoint_url": s3.url})
    manifests = fs.glob("compass-block/runs/*/*/manifest.json")
    assert len(manifests) == 4 and not [m for m in manifests if SECRET in fs.cat(m).decode()]

    missing = write_minimal_spec(tmp_path, **{"name: minimal": "name: minimal-block",
                                              "how:\n": storage.replace("compass-test-s3", "no-such-block")})
    failed = server_cli("run", str(missing), "--until", "ingest", check=False)
    assert failed.returncode == 2 and "no Secret block named 'no-such-block'" in failed.stderr + failed.stdout
