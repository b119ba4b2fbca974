"""On a CUDA machine (`make test-gpu`): one training stage of the minimal spec on this GPU in bf16 with the
attention and loss `auto` picks, checkpointed and resumed: the run trains, resuming from a checkpoint continues to
the same losses (within bf16's reproducibility on a GPU), and the rank check runs on NCCL's device."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu


def losses(workdir: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (workdir / "metrics.jsonl").read_text().splitlines()]


def on_gpu(job, steps: int = 6):
    from compass.specs.how import Checkpoints

    if not torch.cuda.is_available():
        raise RuntimeError("make test-gpu needs a CUDA device: run it on a GPU node")
    recipe = job.recipe
    stage = recipe.stages[0].model_copy(update={"tokens": steps * 4 * 64})
    job = job.model_copy(update={"recipe": recipe.model_copy(update={"stages": [stage, *recipe.stages[1:]]})})
    return job.with_how(hardware=job.hardware.model_copy(update={"accelerator": "h100"}), precision="bf16",
                        checkpoints=Checkpoints(every_steps=3, keep_last=5))


def test_a_bf16_stage_trains_checkpoints_and_resumes_on_this_gpu(stage1_job, tmp_path: Path):
    from compass.model.training.trainer import train_stage

    straight = tmp_path / "straight"
    result = train_stage(on_gpu(stage1_job(straight, deepspeed=False)))
    assert result.setup.precision == "bf16" and result.steps == 6
    assert all(r.device.startswith("cuda") for r in result.ranks)
    resumed = tmp_path / "resumed"
    (resumed / "checkpoints").mkdir(parents=True)
    shutil.copytree(straight / "checkpoints" / "step-00000003", resumed / "checkpoints" / "step-00000003")
    again = train_stage(on_gpu(stage1_job(resumed, deepspeed=False)))
    assert again.resumed_from == 3
    assert losses(resumed)[-3:] == pytest.approx(losses(straight)[-3:], rel=2e-2)


def test_fsdp2_trains_in_bf16_and_resumes_from_its_shards_on_this_gpu(stage1_job, tmp_path: Path):
    """FSDP2 on one GPU: bf16 compute under its mixed-precision policy (fp32 master weights), DCP checkpoints, and a
    resume that continues to the same losses."""
    from compass.model.training.trainer import train_stage

    fsdp2 = {"engine": "fsdp2", "deepspeed": False, "zero_stage": 0}
    straight = tmp_path / "straight"
    result = train_stage(on_gpu(stage1_job(straight, **fsdp2)))
    assert result.setup.engine == "fsdp2" and result.setup.precision == "bf16" and result.steps == 6
    assert (straight / "checkpoints" / "step-00000003" / "dcp" / ".metadata").exists()
    resumed = tmp_path / "resumed"
    (resumed / "checkpoints").mkdir(parents=True)
    shutil.copytree(straight / "checkpoints" / "step-00000003", resumed / "checkpoints" / "step-00000003")
    again = train_stage(on_gpu(stage1_job(resumed, **fsdp2)))
    assert again.resumed_from == 3
    assert losses(resumed)[-3:] == pytest.approx(losses(straight)[-3:], rel=2e-2)


def test_a_deepspeed_bf16_stage_trains_checkpoints_and_resumes_on_this_gpu(stage1_job, tmp_path: Path):
    """DeepSpeed's bf16 engine (bf16 weights, fp32 optimizer states) on this GPU, as the SmolLM3 spec trains: the
    start-of-run rank check reads its bf16 weights, and a resume from a checkpoint continues to the same losses."""
    from compass.model.training.trainer import train_stage

    straight = tmp_path / "straight"
    result = train_stage(on_gpu(stage1_job(straight, deepspeed=True, zero_stage=0)))
    assert (result.setup.engine, result.setup.precision, result.steps) == ("deepspeed", "bf16", 6)
    assert all(r.device.startswith("cuda") for r in result.ranks)
    resumed = tmp_path / "resumed"
    (resumed / "checkpoints").mkdir(parents=True)
    shutil.copytree(straight / "checkpoints" / "step-00000003", resumed / "checkpoints" / "step-00000003")
    again = train_stage(on_gpu(stage1_job(resumed, deepspeed=True, zero_stage=0)))
    assert again.resumed_from == 3
    assert losses(resumed)[-3:] == pytest.approx(losses(straight)[-3:], rel=2e-2)


@pytest.mark.gpu_extra
def test_the_trainer_runs_flash_varlen_attention_at_micro_batch_3(stage1_job, tmp_path: Path):
    """The SmolLM3 spec's micro-batch of 3 packed rows through flash-attn's varlen kernels (the documents' lengths
    passed in) in the trainer, against the same stage with compass's per-document SDPA: the same losses within
    bf16's tolerance."""
    from compass.model.attention import flash_kernel
    from compass.model.training.trainer import train_stage

    if flash_kernel() is None:
        raise RuntimeError("neither flash-attn nor flash_attn_interface is installed: pip install "
                           "'compass-lifecycle[gpu]'")

    def at_micro_batch_3(workdir: Path, attention: str):
        job = on_gpu(stage1_job(workdir, deepspeed=False, micro_batch_size=3), steps=4)
        stage = job.recipe.stages[0].model_copy(update={"global_batch_size": 6, "tokens": 4 * 6 * 64})
        recipe = job.recipe.model_copy(update={"stages": [stage, *job.recipe.stages[1:]]})
        return job.model_copy(update={"recipe": recipe}).with_how(
            attention=attention, parallelism=job.parallelism.model_copy(update={"micro_batch_size": 3}))

    flash = train_stage(at_micro_batch_3(tmp_path / "flash", "flash"))
    assert "flash" in flash.setup.attention and flash.steps == 4
    sdpa = train_stage(at_micro_batch_3(tmp_path / "sdpa", "sdpa"))
    assert losses(tmp_path / "flash") == pytest.approx(losses(tmp_path / "sdpa"), rel=3e-2)
    assert sdpa.steps == 4
