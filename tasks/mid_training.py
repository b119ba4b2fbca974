"""Mid-training: continued pretraining on one curated source (a domain mixture) with the pretraining engine,
from the previous stage's full training state, at the context length and RoPE base the model has reached."""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

from compass.tasks.base import StepContext, StepResult


def stage_config(config: dict[str, Any], rope_theta: float, sequence_length: int) -> dict[str, Any]:
    from compass.tasks.long_context import continuation_config

    return continuation_config(config, name=config["name"], tokens=config["tokens"], sequence_length=sequence_length,
                               global_batch_size=config["batch_size"], mixture={config["dataset"]: 1.0},
                               rope_theta=rope_theta, lr=config["lr"])


def run_mid_training(ctx: StepContext) -> StepResult:
    from compass.tasks.evaluate import tokens_seen
    from compass.tasks.long_context import inference_scaling
    from compass.tasks.pretrain import build_job, train_and_export

    previous = ctx.inputs["previous"].local()
    if not (previous / "state").exists():
        raise ValueError(f"mid-training {ctx.name} continues a training state, and {ctx.inputs['previous'].step_id} "
                         "has none: put mid-training right after pretraining or long-context extension")
    hf = json.loads((previous / "final" / "config.json").read_text())
    rope = hf.get("rope_parameters") or {}
    theta = rope.get("rope_theta", hf.get("rope_theta", 10000.0))
    length = rope.get("original_max_position_embeddings") or hf["max_position_embeddings"]
    job = build_job(replace(ctx, config=stage_config(ctx.config, theta, length)))
    job["tokens_before"] = tokens_seen(previous) or 0
    scaling = ({"kind": rope["rope_type"], "factor": rope["factor"]} if rope.get("rope_type") in ("yarn", "linear")
               else None)
    result = train_and_export(ctx, job, "mid-training", inference_scaling(scaling, length, theta))
    result.metrics.update({"method": "mid_training", "sequence_length": length})
    return result
