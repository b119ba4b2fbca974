"""N3's second half: a site whose GPU partition takes only jobs that ask for GPUs (a job_submit.lua rule, as many
GPU sites have: tests/slurm_cluster.GPU_JOBS_ONLY), and a partition `cpu` of the same nodes for the rest. The probe
asks each partition what the spec's jobs there ask: a GPU where phases train, none for the data phase. Before, one
probe asked no GPU on the spec's partition: refused there, so `compass plan` of a GPU spec failed on such a site
whatever the spec said, and the data jobs, sent to the GPU partition without a GPU, had no partition of their own."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import REPO, VENV_BIN, base_env, running_cluster, write_minimal_spec

pytestmark = pytest.mark.slow

GPU_HOW = """how:
  hardware: {accelerator: h100, devices_per_node: 2}
  precision: bf16
  parallelism: {zero_stage: 1, data_parallel: 2, micro_batch_size: 1}
  orchestration: {cluster: {kind: slurm, poll_seconds: 0.5, shared_root: SHARED}}
"""


@pytest.fixture(scope="module")
def gpu_only_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    with running_cluster(tmp_path_factory.mktemp("gpu-only"), gpus_per_node=2, gpu_jobs_only=True) as env:
        yield env


def history(env: dict[str, str]) -> list[dict[str, str]]:
    log = Path(env["SLURM_CONF"]).with_name("jobcomp.log")
    lines = log.read_text().splitlines() if log.exists() else []
    return [dict(field.split("=", 1) for field in line.split() if "=" in field) for line in lines if line.strip()]


def srun(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["srun", "--cpus-per-task=1", *args, "true"], env={**os.environ, **env},
                          capture_output=True, text=True, timeout=120)


def gpu_spec(folder: Path, resources: str = "") -> Path:
    """The minimal spec trained on 2 GPUs of the cluster's node, its data phase where `resources` says."""
    spec = write_minimal_spec(folder, **{"how:\n  parallelism: {micro_batch_size: 2}\n": ""})
    spec.write_text(spec.read_text() + GPU_HOW.replace("SHARED", str(folder / "shared")) + resources)
    return spec


def plan(folder: Path, spec: Path) -> subprocess.CompletedProcess:
    return subprocess.run([str(VENV_BIN / "compass"), "plan", str(spec), "--store", str(folder / "store"), "--json"],
                          cwd=REPO, env=base_env(folder / "prefect"), capture_output=True, text=True, timeout=600)


def test_the_sites_rule_refuses_a_job_that_asks_no_gpu_on_the_gpu_partition(gpu_only_cluster):
    refused = srun(gpu_only_cluster)
    assert refused.returncode != 0 and "takes only jobs that ask for GPUs" in refused.stderr
    assert srun(gpu_only_cluster, "--gpus-per-node=1").returncode == 0
    assert srun(gpu_only_cluster, "--partition=cpu").returncode == 0


def test_each_partition_is_probed_with_what_its_jobs_ask(gpu_only_cluster, tmp_path: Path):
    before = {j["JobId"] for j in history(gpu_only_cluster)}
    spec = gpu_spec(tmp_path, "  resources: {data: {partition: cpu}}\n")
    done = plan(tmp_path, spec)
    assert done.returncode == 0, done.stderr[-3000:]
    probes = [j for j in history(gpu_only_cluster) if j["JobId"] not in before]
    # the GPU partition's probe asked a GPU (the rule let it run), the data phase's ran on the partition cpu
    assert sorted((j["Name"], j["Partition"], j["JobState"]) for j in probes) == [
        ("compass-probe", "cpu", "COMPLETED"), ("compass-probe", "debug", "COMPLETED")]
    (placement,) = [s for s in json.loads(done.stdout)["sections"] if s["title"] == "Where each phase runs"]
    runs_as = {row[0]: row[-1] for row in placement["rows"]}
    assert runs_as["data"] == "Slurm jobs; curation and tokenization as job arrays of 1-CPU tasks on partition cpu"
    assert runs_as["pretraining"] == "Slurm job, whole nodes"  # the cluster's partition: not repeated


def test_phases_that_share_a_partition_are_probed_by_one_job(gpu_only_cluster, tmp_path: Path):
    """Issue 42 (g): every phase on the partition `cpu` (whose nodes have the GPUs), training with GPUs and the data
    jobs without: one probe job, with a GPU; the controller alone is asked whether it takes the data jobs (`sbatch
    --test-only`: no job runs). Before, a second probe job ran there without a GPU."""
    before = {j["JobId"] for j in history(gpu_only_cluster)}
    spec = gpu_spec(tmp_path)
    spec.write_text(spec.read_text().replace("shared_root: ", "partition: cpu, shared_root: "))
    done = plan(tmp_path, spec)
    assert done.returncode == 0, done.stderr[-3000:]
    probes = [(j["Name"], j["Partition"], j["JobState"]) for j in history(gpu_only_cluster) if j["JobId"] not in before]
    assert probes == [("compass-probe", "cpu", "COMPLETED")]


def test_data_jobs_the_gpu_partition_refuses_are_named_before_anything_is_submitted(gpu_only_cluster,
                                                                                     tmp_path: Path):
    before = {j["JobId"] for j in history(gpu_only_cluster)}
    done = plan(tmp_path, gpu_spec(tmp_path))
    assert done.returncode == 2, done.stderr[-3000:]
    said = " ".join(done.stderr.split())  # the terminal wraps long lines
    assert "how.resources.data.partition" in said and "takes only jobs that ask for GPUs" in said, said[-3000:]
    assert "did not take a one-task job without a GPU, as the data jobs ask" in said, said[-3000:]
    unknown = plan(tmp_path, gpu_spec(tmp_path, "  resources: {data: {partition: cpu-nodes}}\n"))
    assert unknown.returncode == 2 and "how.resources.data.partition: Slurm has no partition 'cpu-nodes'" in \
        " ".join(unknown.stderr.split()), unknown.stderr[-3000:]
    new = [(j["Name"], j["Partition"]) for j in history(gpu_only_cluster) if j["JobId"] not in before]
    assert new == [("compass-probe", "debug")]  # the training phases' probe (with a GPU), and no step's job
    assert not (tmp_path / "store").exists()


def test_the_data_phases_jobs_and_arrays_go_to_its_partition(gpu_only_cluster, prefect_server: str, tmp_path: Path):
    """The code source's ingest and curation as Slurm jobs and datatrove job arrays: the site's rule refuses any of
    them that reaches the GPU partition without a GPU, so each ran on `cpu` or the run failed."""
    before = {j["JobId"] for j in history(gpu_only_cluster)}
    spec = gpu_spec(tmp_path, "  resources: {data: {partition: cpu}}\n")
    done = subprocess.run([str(VENV_BIN / "compass"), "run", str(spec), "--store", str(tmp_path / "store"), "--until",
                           "curate:code", "--json"], cwd=REPO,
                          env=base_env(tmp_path / "prefect") | {"PREFECT_API_URL": prefect_server}, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert {s["step"] for s in json.loads(done.stdout)["steps"] if s["executed"]} == {"ingest:code", "curate:code"}
    jobs = [j for j in history(gpu_only_cluster) if j["JobId"] not in before and j["Name"] != "compass-probe"]
    assert len(jobs) >= 3 and {j["Partition"] for j in jobs} == {"cpu"}, jobs  # 2 steps' jobs and their arrays
    assert {j["JobState"] for j in jobs} == {"COMPLETED"}
