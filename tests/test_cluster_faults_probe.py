"""A run that comes back to follow its live job after the probe's record expired submits no probe (issue 74, M1).

A passed shared-root probe answers its question for `cluster.probe_valid_hours` (a day). SmolLM3's stage 1 runs
for weeks on every node of its partition; a `compass run` coming back after 25 hours to follow it used to submit a
new `srun --immediate` probe for a GPU node and exit 2 on the full partition. Past its validity a record is now
reused while a job of this user runs on that partition from a work folder under the shared root (the live run is
its own proof); with no such job the question is asked again. On a real one-node Slurm cluster."""

from __future__ import annotations

import getpass
import json
import subprocess
import time
from pathlib import Path

import pytest

from compass.infra.shared_probe import verified
from compass.specs.how import SlurmCluster
from tests.test_rehearsal_partitions import history

pytestmark = pytest.mark.slow


def wait_for(env: dict[str, str], job: str, state: str, timeout_s: float = 90) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        seen = subprocess.run(["squeue", "-h", "-j", job, "-o", "%T"], env=env, capture_output=True, text=True)
        if seen.stdout.strip() == state or (state == "" and seen.stdout.strip() in ("", "COMPLETED", "CANCELLED")):
            return
        time.sleep(0.3)
    raise AssertionError(f"job {job} never reached {state or 'its end'}")


def test_an_expired_probe_is_reused_while_the_runs_job_is_live_and_asked_again_after(slurm, tmp_path: Path,
                                                                                    monkeypatch):
    import os

    for key, value in slurm.items():
        monkeypatch.setenv(key, value)
    env = {**os.environ}
    shared = tmp_path / "shared"
    (shared / "work").mkdir(parents=True)
    cluster = SlurmCluster(shared_root=str(shared), probe_timeout_s=60)
    first = verified(cluster, [str(shared)], cluster_name="test")
    assert first.passed and not first.reused  # a probe job ran
    record = next((shared / ".compass-probe").glob("verified-*.json"))
    expired = {**json.loads(record.read_text()), "at": time.time() - 25 * 3600}  # 25 hours later
    record.write_text(json.dumps(expired))

    elsewhere = subprocess.run(["sbatch", "--parsable", f"--chdir={tmp_path}", "--wrap", "sleep 300"], env=env,
                               capture_output=True, text=True, check=True).stdout.strip()
    wait_for(env, elsewhere, "RUNNING")
    jobs = len(history(slurm))
    try:
        outside = verified(cluster, [str(shared)], cluster_name="test", live_job=lambda root, partition: None)
        assert not outside.reused  # nothing live: asked again (a probe job)
        assert len(history(slurm)) == jobs + 1
        record.write_text(json.dumps(expired))
        assert not verified(cluster, [str(shared)], cluster_name="test").reused  # a job outside the root: no proof
        record.write_text(json.dumps(expired))
        live = subprocess.run(["sbatch", "--parsable", f"--chdir={shared / 'work'}", "--wrap", "sleep 300"],
                              env=env, capture_output=True, text=True, check=True).stdout.strip()
        subprocess.run(["scancel", elsewhere], env=env, check=True)
        wait_for(env, live, "RUNNING")
        jobs = len(history(slurm))
        followed = verified(cluster, [str(shared)], cluster_name="test")
        assert followed.reused and followed.live_job == live and followed.passed
        assert len(history(slurm)) == jobs  # no probe job submitted
    finally:
        subprocess.run(["scancel", "-u", getpass.getuser()], env=env)
