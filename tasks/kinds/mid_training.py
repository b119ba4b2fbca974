"""Mid-training: continued pretraining on one curated source (a domain mixture) with the pretraining engine,
from the previous stage's full training state, at the context length and RoPE base the model has reached."""

from __future__ import annotations

import json

from compass.infra.layout import CONTINUED_PARTS, ModelArtifact
from compass.model.training.history import tokens_seen
from compass.specs.architecture import Architecture
from compass.specs.post_training import MidTraining
from compass.specs.training import Monitors, Optimizer, PretrainStage, Schedule, Yarn
from compass.tasks.common.continuation import continuation, inference_scaling
from compass.tasks.common.inputs import TrainingInputs, tokens
from compass.tasks.common.training import build_job, train_and_export
from compass.tasks.steps.context import StepContext, StepResult
from compass.tasks.steps.kind import MODEL_TRAINER_HOW, TRANSFORMERS, PlanBuilder, StepKind
from compass.tasks.steps.placement import phase
from compass.tasks.steps.step_config import StepConfig


class MidTrainingConfig(MidTraining, StepConfig):
    """The spec's mid-training step, with the architecture, optimizer and monitors it trains with."""

    seed: int
    architecture: Architecture
    optimizer: Optimizer
    monitors: Monitors
    intra_document_masking: bool


def provide(plan: PlanBuilder, name: str) -> None:
    """The mid-training step `name` of the spec's post-training list, continuing the newest model: post-training's
    builder asks for it (PlanBuilder.require) where the list puts it, which keeps the list's order."""
    what = plan.spec.what
    pt = what.pretraining
    step = next(p for p in what.post_training if isinstance(p, MidTraining) and p.name == name)
    config = MidTrainingConfig(**dict(step), seed=pt.seed, architecture=what.architecture, optimizer=pt.optimizer,
                               monitors=pt.monitors, intra_document_masking=pt.intra_document_masking)
    previous = plan.newest_model()
    if previous is None:
        raise ValueError(f"mid-training {name} has no model to continue")
    inputs = TrainingInputs(tokenizer=plan.tokenizer(), tokens=tokens(plan, [step.dataset]), previous=previous)
    plan.add(KIND, step.name, config, inputs)


def run_mid_training(ctx: StepContext[MidTrainingConfig]) -> StepResult:
    cfg = ctx.config
    given = ctx.given(TrainingInputs).previous
    if given is None:
        raise ValueError(f"mid-training {ctx.name} was given no model to continue")
    previous = given.local(*CONTINUED_PARTS)
    artifact = ModelArtifact(previous)
    if not artifact.state.exists() and given.step_id.split(":")[0] != "base_model":
        raise ValueError(f"mid-training {ctx.name} continues a training state or a starting checkpoint, and "
                         f"{given.step_id} is neither: put mid-training right after pretraining, "
                         "long-context extension, or what.model.init_from")
    hf = json.loads((artifact.final / "config.json").read_text())
    rope = hf.get("rope_parameters") or {}
    theta = rope.get("rope_theta", hf.get("rope_theta", 10000.0))
    length = rope.get("original_max_position_embeddings") or hf["max_position_embeddings"]
    stage = PretrainStage(name=cfg.name, tokens=cfg.tokens, sequence_length=length, global_batch_size=cfg.batch_size,
                          mixture={cfg.dataset: 1.0})
    recipe = continuation(cfg.architecture, cfg.optimizer, cfg.seed, cfg.intra_document_masking, cfg.monitors, stage,
                          rope_theta=theta, lr=cfg.lr, schedule=Schedule(kind="wsd"))
    job = build_job(ctx, recipe, tokens_before=tokens_seen(previous) or 0)
    scaling = (Yarn(kind=rope["rope_type"], factor=rope["factor"]) if rope.get("rope_type") in ("yarn", "linear")
               else None)
    result = train_and_export(ctx, job, "mid-training", inference_scaling(scaling, length, theta))
    result.metrics.update({"method": "mid_training", "sequence_length": length})
    return result


KIND = StepKind("mid_training", MidTrainingConfig, run_mid_training, None, version="3",
                resources=phase("mid_training"), inputs=TrainingInputs, provide=provide,
                after=("tokenize", "base_model", "tokenizer"), evaluated=True, advances_model=True,
                trains=True, imports=TRANSFORMERS, reads_how=MODEL_TRAINER_HOW,
                headline=("final_loss", "tokens_per_s"))
STEP_KINDS = (KIND,)
