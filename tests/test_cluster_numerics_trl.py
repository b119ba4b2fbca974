"""TRL in the rehearsal computes in the spec's precision (issue 74, item 5): the fine-tune example's shape, SFT with
LoRA on 2 ranks under DeepSpeed ZeRO-2 in bf16, rehearsed on CPU ranks (a GPU spec, COMPASS_REHEARSAL as in the
rehearsal's jobs), runs DeepSpeed's bf16 engine with bf16 weights, as the cluster will; before, a CPU rank loaded
TRL's model in fp32 and the bf16 path was never run before the cluster."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from compass.model.training.rank_device import REHEARSAL_ENV
from tests.conftest import run_up_to
from tests.hub_cache import seed_model, tiny_llama

pytestmark = pytest.mark.slow

REPO_ID = "acme/tiny-base"
SPEC = f"""name: finetune-rehearsed
why:
  reason: research
  question: Does the fine-tune's bf16 ZeRO-2 LoRA path run before the cluster?
  hypothesis: It does, on CPU ranks, in bf16.
  success_criteria:
    - {{metric: "arc_easy:cf/acc", op: ">=", threshold: 0.0, checkpoint: final}}
what:
  model: {{init_from: {REPO_ID}}}
  post_training:
    - {{method: sft, name: sft, dataset: "pypi://evals==3.0.1.post1", lr: 2.0e-4, max_samples: 16, max_length: 128,
       batch_size: 4, peft: {{kind: lora, r: 8, alpha: 16, target_modules: all-linear}}}}
  evaluation:
    benchmarks:
      - {{name: arc_easy, formulation: cf, limit: 8}}
how:
  hardware: {{accelerator: h100, devices_per_node: 2, nodes: 1}}
  resources: {{post_training: {{devices_per_node: 2}}}}
  parallelism: {{deepspeed: true, zero_stage: 2, data_parallel: 2, micro_batch_size: 1}}
  precision: bf16
"""


def test_a_rehearsed_lora_sft_runs_deepspeeds_bf16_engine_on_cpu_ranks(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch):
    import math

    seed_model(tmp_path / "cache", REPO_ID, tiny_llama(tmp_path / "files"))
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path / "cache"))
    monkeypatch.setitem(os.environ, "HF_HUB_CACHE", str(tmp_path / "cache"))  # the ranks' own processes
    monkeypatch.setitem(os.environ, "HF_HUB_OFFLINE", "1")
    monkeypatch.setitem(os.environ, REHEARSAL_ENV, "1")  # as the rehearsal's jobs: the GPU spec's ranks on the CPU
    spec = tmp_path / "spec.yaml"
    spec.write_text(SPEC)
    _, outcomes = run_up_to(spec, "post_train:sft", tmp_path / "store")
    metrics = outcomes["post_train:sft"].manifest.metrics
    assert metrics["setup"] == {"device": "cpu", "precision": "bfloat16", "substituted": []}
    assert metrics["ranks"] == 2  # DeepSpeed's engine reports:
    assert metrics["zero_stage"] == 2 and metrics["engine_precision"] == "bf16"
    assert metrics["weights_dtype"] == "bfloat16"  # what the ranks computed with, not an fp32 copy
    assert metrics["peft"] == "lora" and 0 < metrics["trainable_parameters"] < metrics["total_parameters"]
    assert math.isfinite(metrics["final_loss"])
