"""Ray: with `how.orchestration.task_runner: ray` the lifecycle's steps run as Ray tasks (prefect-ray) and
curation runs on datatrove's RayPipelineExecutor, on a local Ray instance with 2 CPUs, against a real Prefect
server; the results equal the local executors' (same fingerprints, same files, same ablation losses)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import Cli, base_env, seeded, write_minimal_spec
from tests.shards import SHARD_SUFFIX, decompress

pytestmark = pytest.mark.slow

ABLATIONS = """  ablations:
    baseline: {tokens: 2048, sequence_length: 64, global_batch_size: 4, mixture: {notes: 0.7, code: 0.3}}
    variants:
      - {name: untied, change: {architecture.tied_embeddings: false}}
    seeds: [0]
  pretraining:"""
KINDS = ("ingest", "curate", "tokenizer", "tokenize", "ablate", "compare")


def data_files(manifest) -> dict[str, str]:
    """Every output file but datatrove's logs (they hold timings and the executor's own settings)."""
    return {f.path: f.sha256 for f in manifest.files if not f.path.startswith("datatrove-logs/")}


def content(store, uri: str, rel: str) -> bytes:
    data = (store.local_path(uri) / rel).read_bytes()
    return decompress(data) if rel.endswith(SHARD_SUFFIX) else data


def test_ray_fans_out_steps_with_the_same_results_as_local(server_cli: Cli, data_store: Path, tmp_path: Path):
    from compass.flows.compiler import compile_spec
    from compass.flows.runner import run_in_process
    from compass.infra.store import Store
    from compass.specs import load_spec
    from compass.tasks.steps.context import Runtime

    spec = write_minimal_spec(tmp_path, **{"  pretraining:": ABLATIONS, "how:\n": (
        "how:\n  orchestration: {task_runner: ray, ray_num_cpus: 2, workers: 2, max_parallel_steps: 2}\n")})
    until = [arg for kind in KINDS for arg in ("--until", kind)]
    summary = server_cli.json("run", str(spec), "--store", str(tmp_path / "ray-store"), *until)
    steps = {r["step"]: r for r in summary["steps"]}
    assert all(r["executed"] for r in steps.values()) and {"ablate:baseline-s0", "ablate:untied-s0"} <= set(steps)
    workers = {r["pid"] for r in steps.values()}
    assert summary["flow_pid"] not in workers  # every step ran in a Ray worker process, none in the flow's

    # the same plan through the local executors, in this process: its data steps are the session's data store,
    # run that way
    loaded = load_spec(spec)
    plan = compile_spec(loaded.spec).restricted_to(set(KINDS))
    how = loaded.spec.how
    how = how.model_copy(update={"orchestration": how.orchestration.model_copy(update={"task_runner": "local"})})
    local = Store(str(seeded(tmp_path / "local-store", data_store)))
    outcomes = run_in_process(plan, local, loaded.spec_hash, Runtime(how=how, base_dir=loaded.base_dir))
    ours = {step_id: outcome.manifest for step_id, outcome in outcomes.items()}
    ray_store = Store(str(tmp_path / "ray-store"))
    for step_id, manifest in ours.items():
        theirs = ray_store.read_manifest(steps[step_id]["uri"])
        assert theirs.fingerprint == manifest.fingerprint, step_id
        if manifest.kind in ("curate", "tokenize", "tokenizer"):
            assert set(data_files(theirs)) == set(data_files(manifest)), step_id
            for rel in data_files(manifest):  # the shards' content (a store's manifests differ)
                assert content(ray_store, theirs.uri, rel) == content(local, manifest.uri, rel), (step_id, rel)
        if manifest.kind == "ablate":
            assert theirs.metrics["val_loss"] == pytest.approx(manifest.metrics["val_loss"], rel=1e-5), step_id


def test_ray_without_a_server_is_refused_clearly(tmp_path: Path):
    spec = write_minimal_spec(tmp_path, **{"how:\n": "how:\n  orchestration: {task_runner: ray}\n"})
    done = Cli(tmp_path, base_env(tmp_path / "home"))("run", str(spec), check=False)
    assert done.returncode == 2 and "needs a Prefect server" in done.stderr and "PREFECT_API_URL" in done.stderr
    assert not (tmp_path / "store").exists()


def test_a_local_ray_instance_runs_its_workers_at_the_drivers_priority():
    """Ray's default niceness 15 starved the run's workers behind any other busy process on the node."""
    import os

    import ray

    from compass.flows.lifecycle import local_ray_init_kwargs
    from compass.specs.how import Orchestration

    ray.init(**local_ray_init_kwargs(Orchestration(task_runner="ray", ray_num_cpus=1)), include_dashboard=False)
    try:
        assert ray.get(ray.remote(lambda: os.nice(0)).remote()) == os.nice(0)
    finally:
        ray.shutdown()
