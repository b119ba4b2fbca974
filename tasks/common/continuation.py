"""A stage that continues a trained model (long-context extension, mid-training): its recipe, and the RoPE base
and scaling written into the exported config."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from compass.model.training.job import StageRecipe
from compass.specs.architecture import Architecture
from compass.specs.training import Monitors, Optimizer, PretrainStage, Schedule, Yarn


def continuation(architecture: Architecture, optimizer: Optimizer, seed: int, masking: bool, monitors: Monitors,
                 stage: PretrainStage, *, rope_theta: float, lr: float, schedule: Schedule) -> StageRecipe:
    """The recipe of one stage that continues a trained model (long-context extension, mid-training): the same
    architecture at a new RoPE base, its own budget, mixture, LR and schedule."""
    positions = architecture.positions.model_copy(update={"rope_theta": rope_theta})
    return StageRecipe(architecture=architecture.model_copy(update={"positions": positions}),
                       optimizer=optimizer.model_copy(update={"lr": lr}), schedule=schedule, stages=[stage],
                       stage=stage.name, seed=seed, intra_document_masking=masking, monitors=monitors)


def inference_scaling(scaling: Yarn | None, trained_length: int, rope_theta: float) -> Callable[[Path], None]:
    """Writes the RoPE base and, if asked, YaRN/linear scaling beyond the trained length into config.json."""

    def apply(folder: Path) -> None:
        path = folder / "config.json"
        config = json.loads(path.read_text())
        params = {"rope_type": "default", "rope_theta": rope_theta}
        if scaling:
            params = {"rope_type": scaling.kind, "rope_theta": rope_theta, "factor": scaling.factor,
                      "original_max_position_embeddings": trained_length}
            config["max_position_embeddings"] = int(trained_length * scaling.factor)
        else:
            config["max_position_embeddings"] = trained_length
        config["rope_parameters"] = params
        config["rope_theta"] = rope_theta
        path.write_text(json.dumps(config, indent=2))

    return apply
