"""The store on a real S3-compatible server (moto in server mode on 127.0.0.1): a run, a cached re-run,
and lineage read from s3:// manifests; credentials never reach the manifests."""

from __future__ import annotations

import json
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import VENV_BIN, Cli, free_port, write_minimal_spec

pytestmark = pytest.mark.slow
SECRET = "compass-test-secret-key"


@pytest.fixture(scope="module")
def s3_endpoint(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    port = free_port()
    log = tmp_path_factory.mktemp("moto") / "moto.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([str(VENV_BIN / "moto_server"), "-H", "127.0.0.1", "-p", str(port)],
                                stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(60):
            try:
                urllib.request.urlopen(url, timeout=1)
                break
            except OSError:
                time.sleep(0.5)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_run_and_cached_rerun_on_s3(server_cli: Cli, tmp_path: Path, s3_endpoint: str):
    import boto3

    env = {"AWS_ACCESS_KEY_ID": "compass-test", "AWS_SECRET_ACCESS_KEY": SECRET, "AWS_DEFAULT_REGION": "us-east-1",
           "AWS_ENDPOINT_URL": s3_endpoint, "AWS_EC2_METADATA_DISABLED": "true"}
    server_cli.env.update(env)
    boto3.client("s3", endpoint_url=s3_endpoint, aws_access_key_id="compass-test", aws_secret_access_key=SECRET,
                 region_name="us-east-1").create_bucket(Bucket="compass-test")
    spec = write_minimal_spec(tmp_path, **{"name: minimal": "name: minimal-s3"})
    root = "s3://compass-test/runs"

    first = server_cli.json("run", str(spec), "--store", root)
    assert {s["step"] for s in first["steps"] if s["executed"]} == {
        "ingest:notes", "curate:notes", "ingest:code", "curate:code", "tokenizer:select", "tokenize:notes",
        "tokenize:code", "pretrain:stage1", "pretrain:stage2"}
    assert all(s["uri"].startswith(root + "/") for s in first["steps"])
    second = server_cli.json("run", str(spec), "--store", root)
    assert not [s for s in second["steps"] if s["executed"]]

    tokenizer_uri = next(s["uri"] for s in first["steps"] if s["step"] == "tokenizer:select")
    tree = server_cli.json("lineage", f"{tokenizer_uri}/chosen/tokenizer.json")
    assert {c["step"] for c in tree["inputs"]} == {"curate:notes", "curate:code"}

    import s3fs

    fs = s3fs.S3FileSystem(key="compass-test", secret=SECRET, client_kwargs={"endpoint_url": s3_endpoint})
    manifests = fs.glob("compass-test/runs/*/*/manifest.json")
    assert len(manifests) == 9
    for path in manifests:
        text = fs.cat(path).decode()
        assert SECRET not in text
        manifest = json.loads(text)
        for entry in manifest["files"]:  # every listed file is there with its size
            assert fs.size(f"{path.rsplit('/', 1)[0]}/{entry['path']}") == entry["size"]


def test_training_resumes_from_checkpoints_mirrored_to_s3(server_cli: Cli, tmp_path: Path, s3_endpoint: str):
    """Kill -9 `compass run` mid-stage, lose the machine's local work folder, run again: the step resumes
    from the checkpoint mirrored to S3 in the background."""
    import os
    import signal

    import boto3
    import s3fs

    env = {"AWS_ACCESS_KEY_ID": "compass-test", "AWS_SECRET_ACCESS_KEY": SECRET, "AWS_DEFAULT_REGION": "us-east-1",
           "AWS_ENDPOINT_URL": s3_endpoint, "AWS_EC2_METADATA_DISABLED": "true",
           "COMPASS_CACHE": str(tmp_path / "machine-cache")}
    server_cli.env.update(env)
    boto3.client("s3", endpoint_url=s3_endpoint, aws_access_key_id="compass-test", aws_secret_access_key=SECRET,
                 region_name="us-east-1").create_bucket(Bucket="compass-resume")
    spec = write_minimal_spec(tmp_path, **{
        "name: minimal": "name: minimal-resume",
        "tokens: 20000, sequence_length: 64": "tokens: 150000, sequence_length: 64",
        "parallelism: {micro_batch_size: 2}": "parallelism: {micro_batch_size: 2}\n  checkpoints: {every_steps: 100}"})
    root = "s3://compass-resume/runs"
    fs = s3fs.S3FileSystem(key="compass-test", secret=SECRET, client_kwargs={"endpoint_url": s3_endpoint})
    proc = subprocess.Popen([str(VENV_BIN / "compass"), "run", str(spec), "--store", root], cwd=tmp_path,
                            env=server_cli.env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    deadline = time.monotonic() + 600
    while not fs.glob("compass-resume/runs/.work/pretrain/stage1-*/checkpoints/step-*/checksums.json"):
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
    assert manifest["metrics"]["resumed_from"] >= 100
    fs.invalidate_cache()
    assert not fs.glob("compass-resume/runs/.work/pretrain/stage1-*/checkpoints/*")  # cleared after commit
