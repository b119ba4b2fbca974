"""Long-context extension stage: continue from the previous stage at a longer sequence length and a larger
RoPE base, on a mixture that upweights long documents, which the packer keeps whole. NoPE layers and
intra-document masking carry over (same architecture and masking); YaRN or linear scaling for lengths beyond
the trained one is written into the exported config."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

from compass.tasks.base import StepContext, StepResult


def continuation_config(config: dict[str, Any], *, name: str, tokens: float, sequence_length: int,
                        global_batch_size: int, mixture: dict[str, float], rope_theta: float, lr: float,
                        schedule: str = "wsd", warmup_steps: int = 0) -> dict[str, Any]:
    """The pretraining-engine config of one stage that continues a trained model (long-context extension,
    mid-training): the same architecture at a new RoPE base, its own budget, mixture and LR schedule."""
    arch = json.loads(json.dumps(config["architecture"]))
    arch["positions"]["rope_theta"] = rope_theta
    return {
        "architecture": arch, "optimizer": {**config["optimizer"], "lr": lr},
        "schedule": {"kind": schedule, "warmup_steps": warmup_steps, "decay_fraction": 0.2,
                     "min_lr_ratio": 0.0, "milestones": [], "gamma": 1.0},
        "stages": [{"name": name, "tokens": tokens, "sequence_length": sequence_length,
                    "global_batch_size": global_batch_size, "mixture": mixture,
                    "schedule_segment": "auto", "reset_optimizer": False}],
        "stage": name, "seed": config["seed"], "intra_document_masking": config["intra_document_masking"],
        "monitors": config["monitors"],
    }


def stage_config(config: dict[str, Any]) -> dict[str, Any]:
    """One extension stage: its own length, RoPE base, token budget, mixture and LR schedule."""
    stage = config["stage"]
    return continuation_config(config, name=stage["name"], tokens=stage["tokens"],
                               sequence_length=stage["sequence_length"], global_batch_size=stage["global_batch_size"],
                               mixture=stage["mixture"], rope_theta=stage["rope_theta"], lr=stage["lr"],
                               schedule=stage["schedule"], warmup_steps=stage["warmup_steps"])


def inference_scaling(scaling: dict[str, Any] | None, trained_length: int, rope_theta: float):
    """Writes the RoPE base and, if asked, YaRN/linear scaling beyond the trained length into config.json."""

    def apply(folder: Path) -> None:
        path = folder / "config.json"
        config = json.loads(path.read_text())
        params = {"rope_type": "default", "rope_theta": rope_theta}
        if scaling:
            params = {"rope_type": scaling["kind"], "rope_theta": rope_theta, "factor": scaling["factor"],
                      "original_max_position_embeddings": trained_length}
            config["max_position_embeddings"] = int(trained_length * scaling["factor"])
        else:
            config["max_position_embeddings"] = trained_length
        config["rope_parameters"] = params
        config["rope_theta"] = rope_theta
        path.write_text(json.dumps(config, indent=2))

    return apply


def run_long_context(ctx: StepContext) -> StepResult:
    from compass.tasks.pretrain import build_job, train_and_export

    stage = ctx.config["stage"]
    job = build_job(replace(ctx, config=stage_config(ctx.config)))
    from compass.tasks.evaluate import tokens_seen

    job["whole_from"] = ctx.config["previous_length"]
    job["tokens_before"] = tokens_seen(ctx.inputs["previous"].local()) or 0
    if stage.get("micro_batch_size"):
        job["micro_batch_size"] = stage["micro_batch_size"]
    export = inference_scaling(ctx.config.get("inference_scaling"), stage["sequence_length"], stage["rope_theta"])
    result = train_and_export(ctx, job, "long-context", export)
    result.metrics.update({"sequence_length": stage["sequence_length"], "rope_theta": stage["rope_theta"]})
    return result
