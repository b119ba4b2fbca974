"""FSDP2 with tensor parallelism (DTensor plans from the model's own tp_plan) on CPU processes (gloo): 4 ranks as
2 data-parallel x 2 tensor-parallel train a Qwen3-style model (per-head q/k norms, whose gradients are summed over
the tensor-parallel ranks) like one process, export the same weights, and their checkpoint resumes without tensor
parallelism on 2 ranks (DCP reshards the 2-D shards)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.test_fsdp2 import FSDP2, launch_ranks, resume_first_checkpoint
from tests.test_tensor_parallel import final_weights, losses


def _qwen3(job, steps: int = 20):
    """The job with per-head q/k norms (Qwen3) and a stage of `steps` steps of 4 x 64 tokens."""
    recipe = job.recipe
    stage = recipe.stages[0].model_copy(update={"tokens": steps * 4 * 64})
    arch = recipe.architecture.model_copy(update={"qk_norm": True})
    return job.model_copy(update={"recipe": recipe.model_copy(update={"stages": [stage], "architecture": arch})})


@pytest.mark.slow
def test_fsdp2_with_tensor_parallelism_trains_like_one_process_and_resumes_without_it(stage1_job, tmp_path: Path):
    single = _qwen3(stage1_job(tmp_path / "one", deepspeed=False))
    assert launch_ranks(single, tmp_path / "one", 1).wait(900) == 0
    both = {**FSDP2, "data_parallel": 2, "tensor_parallel": 2, "micro_batch_size": 1}
    assert launch_ranks(_qwen3(stage1_job(tmp_path / "tp", **both)), tmp_path / "tp", 4).wait(900) == 0

    assert losses(tmp_path / "tp") == pytest.approx(losses(tmp_path / "one"), rel=1e-4)
    # the global norm: each projection's 2-D shards and the rest's data-parallel shards, each counted once
    # (the stage's last step, at learning rate 0, differs by 1.9e-3 from the one process's since the windowed reads
    # of d46ed11, as in the HSDP test: every earlier step within 5e-4; recorded in issue 74's note to explain)
    tp_norms, one_norms = losses(tmp_path / "tp", "grad_norm"), losses(tmp_path / "one", "grad_norm")
    assert tp_norms[:-1] == pytest.approx(one_norms[:-1], rel=1e-3)
    assert tp_norms[-1] == pytest.approx(one_norms[-1], rel=3e-3)
    result = json.loads((tmp_path / "tp" / "result.json").read_text())
    assert "4 ranks (2 data-parallel x 2 tensor-parallel)" in result["rank_check"]
    assert "distinct shards" in result["rank_check"] and "shards gathered equal" in result["rank_check"]
    assert result["setup"]["sharding"] == "FSDP2 over 2 ranks, tensor-parallel 2"
    a, b = final_weights(tmp_path / "one"), final_weights(tmp_path / "tp")  # written from the 2-D shards
    assert set(a) - set(b) <= {"lm_head.weight"}
    assert all(a[k].shape == b[k].shape and (a[k] - b[k]).abs().max() < 1e-4 for k in b), \
        max((a[k] - b[k]).abs().max() for k in b)
    assert any("q_norm" in k for k in b)  # the norms whose gradients every tensor-parallel rank contributes to

    plain = resume_first_checkpoint(tmp_path / "tp", tmp_path / "plain", 2,
                                    lambda folder: _qwen3(stage1_job(folder, **{**FSDP2, "micro_batch_size": 1})))
    assert losses(plain)[-1] == pytest.approx(losses(tmp_path / "tp")[-1], rel=1e-4)
