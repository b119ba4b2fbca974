"""lighteval on the evaluate step's devices: with `how.resources.evaluation` giving 2 devices, the step starts 2
ranks (torchrun here, srun in a Slurm job) and lighteval's accelerate launcher splits each benchmark's samples over
them (gloo here, NCCL on GPUs); the scores are exactly one process's."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from tests.conftest import seeded, write_minimal_spec

pytestmark = pytest.mark.slow

SUITE = """  evaluation:
    perplexity_sources: [notes]
    benchmarks:
      - {name: arc_easy, formulation: cf, limit: 40}
      - {name: arithmetic, formulation: gen, limit: 6}
  pretraining:"""
STEP = "evaluate:pretrain-stage2"


def spec(folder: Path, devices: int) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    return write_minimal_spec(folder, **{"  pretraining:": SUITE, "how:\n": f"how:\n  resources: {{evaluation: "
                                                                                f"{{devices_per_node: {devices}}}}}\n"})


def test_two_ranks_score_exactly_what_one_process_scores(trained_store: Path, tmp_path: Path,
                                                         caplog: pytest.LogCaptureFixture):
    from tests.test_post_training_scale import run_steps

    for folder in ("one", "two"):  # the minimal spec's pretraining, committed
        seeded(tmp_path / folder / "store", trained_store)
    one = run_steps(spec(tmp_path / "one", 1), tmp_path / "one" / "store", [STEP])[STEP].manifest.metrics
    with caplog.at_level(logging.INFO):
        two = run_steps(spec(tmp_path / "two", 2), tmp_path / "two" / "store", [STEP])[STEP].manifest.metrics
    launched = [r.getMessage() for r in caplog.records if "compass.tasks.evaluation.lighteval_ranks" in r.getMessage()]
    assert launched and "--nproc-per-node 2" in launched[0].replace("_", "-")  # the benchmarks ran on 2 ranks
    scores = sorted(k for k in one if k.startswith(("arc_easy", "arithmetic")))
    assert scores == ["arc_easy:cf/acc", "arithmetic:gen/verified_acc"]
    assert {k: two[k] for k in scores} == {k: one[k] for k in scores}
    assert two["val_ppl:notes"] == one["val_ppl:notes"]  # the step's own measures, in its process as before


def test_vllm_evaluation_on_several_nodes_is_refused(tmp_path: Path):
    from compass.specs.loader import SpecError, load_spec

    folder = tmp_path / "vllm"
    folder.mkdir()
    path = write_minimal_spec(folder, **{"  pretraining:": SUITE, "how:\n": (
        "how:\n  generation: vllm\n  hardware: {accelerator: h100, hosts: [a, b]}\n"
        "  resources: {evaluation: {nodes: 2, devices_per_node: 8}}\n")})
    with pytest.raises(SpecError) as refused:
        load_spec(path)
    assert "how.resources.evaluation.nodes" in str(refused.value) and "one node's GPUs" in str(refused.value)
