"""Prefect's tag concurrency limit, set by `compass deploy`, keeps GPU steps from running at once across the
server, even when a spec lets its own process run two of them together."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.conftest import Cli, prefect_client, remove_gpu_limit, seeded, write_minimal_spec

pytestmark = pytest.mark.slow
TWO_GPU_STEPS = """  ablations:
    baseline: {tokens: 2048, sequence_length: 64, global_batch_size: 4, mixture: {notes: 0.7, code: 0.3}}
    variants:
      - {name: untied, change: {architecture.tied_embeddings: false}}
  pretraining:"""


def gpu_intervals(api_url: str, run_name: str, tags: list[str]) -> list[tuple[float, float]]:
    """Start and end of the ablation task runs of the latest flow run named `run_name`, each tagged `tags`. The
    server records task run states from events, after the flow has returned: it is asked again until both
    ablations' times are in."""
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterName
    from prefect.client.schemas.sorting import FlowRunSort

    deadline = time.monotonic() + 120
    while True:
        with prefect_client(api_url) as client:
            (run, *_) = client.read_flow_runs(flow_run_filter=FlowRunFilter(name=FlowRunFilterName(any_=[run_name])),
                                             sort=FlowRunSort.START_TIME_DESC, limit=1)
            tasks = client.read_task_runs(flow_run_filter=FlowRunFilter(id={"any_": [run.id]}))
        ablations = [t for t in tasks if t.name.startswith("ablate:")]
        assert [t.tags for t in ablations] == [tags] * len(ablations), [(t.name, t.tags) for t in ablations]
        if len(ablations) == 2 and all(t.start_time and t.end_time for t in ablations):
            return sorted((t.start_time.timestamp(), t.end_time.timestamp()) for t in ablations)
        assert time.monotonic() < deadline, [(t.name, t.start_time, t.end_time) for t in ablations]
        time.sleep(0.5)


def overlap(intervals: list[tuple[float, float]]) -> float:
    (a_start, a_end), (b_start, b_end) = intervals
    return min(a_end, b_end) - max(a_start, b_start)


def test_gpu_tag_limit_serialises_gpu_steps_across_the_server(server_cli: Cli, prefect_server: str,
                                                              data_store: Path, tmp_path: Path):
    spec = write_minimal_spec(tmp_path, **{
        "  pretraining:": TWO_GPU_STEPS,
        "how:\n": "how:\n  orchestration: {max_parallel_steps: 2, max_parallel_gpu_steps: 2}\n"})
    kinds = [arg for kind in ("ingest", "curate", "tokenizer", "tokenize", "ablate") for arg in ("--until", kind)]
    remove_gpu_limit(prefect_server)  # whatever an earlier test on this server deployed

    free = seeded(tmp_path / "free", data_store)  # the data steps committed: the run's work is the two ablations
    server_cli("run", str(spec), "--store", str(free), *kinds)
    # the spec alone lets both run together; with no limit on the server no task is tagged (no slot asked for)
    assert overlap(gpu_intervals(prefect_server, "minimal-" + _hash(spec), [])) > 0

    deployed = server_cli.json("deploy", "--gpu-slots", "1")
    assert deployed["gpu_slots"] == 1
    try:
        server_cli("run", str(spec), "--store", str(seeded(tmp_path / "limited", data_store)), *kinds)
        assert overlap(gpu_intervals(prefect_server, "minimal-" + _hash(spec), ["gpu"])) <= 0  # one at a time
    finally:
        with prefect_client(prefect_server) as client:
            client.delete_concurrency_limit_by_tag("gpu")


def _hash(spec: Path) -> str:
    from compass.specs import load_spec

    return load_spec(spec).spec_hash[:8]
