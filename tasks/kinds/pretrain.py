"""Pretraining stages: each continues the previous stage, trains its tokens on its mixture, exports Hugging Face
checkpoints, and publishes metrics and the loss curve. One LR schedule spans all stages."""

from __future__ import annotations

from compass.model.training.job import StageRecipe
from compass.tasks.common.inputs import TrainingInputs, training_inputs
from compass.tasks.common.training import build_job, train_and_export
from compass.tasks.steps.context import StepContext, StepResult
from compass.tasks.steps.kind import MODEL_TRAINER_HOW, TRANSFORMERS, PlanBuilder, StepKind
from compass.tasks.steps.placement import phase
from compass.tasks.steps.step_config import StepConfig


class PretrainConfig(StageRecipe, StepConfig):
    """A stage and the schedule around it. `stages` lists the stages the schedule spans: with WSD, a stable
    stage does not depend on the stages after it, so extending a run keeps the stages before cached."""


def build(plan: PlanBuilder) -> None:
    pt = plan.spec.what.pretraining
    needs_total = pt.schedule.kind != "wsd" or all(s.schedule_segment == "auto" for s in pt.stages)
    base = plan.of_kind("base_model")
    previous = base[0].ref if base else None  # continued pretraining of a starting checkpoint
    for i, stage in enumerate(pt.stages):
        spanned = pt.stages if needs_total or stage.schedule_segment == "decay" else pt.stages[: i + 1]
        config = PretrainConfig(architecture=plan.spec.what.architecture, optimizer=pt.optimizer,
                                schedule=pt.schedule, stages=spanned, stage=stage.name, seed=pt.seed,
                                intra_document_masking=pt.intra_document_masking, monitors=pt.monitors)
        # a first stage waits for the gates' verdict (the starting checkpoint waits for it too)
        previous = plan.add(KIND, stage.name, config, training_inputs(plan, stage.mixture, previous))


def run_pretrain(ctx: StepContext[PretrainConfig]) -> StepResult:
    return train_and_export(ctx, build_job(ctx, ctx.config), "pretrain")


# 2: a stream per batch row (each rank packs its own rows), chunked loss, per-document attention
KIND = StepKind("pretrain", PretrainConfig, run_pretrain, build, version="4", resources=phase("pretraining"),
                trains=True, reads_how=MODEL_TRAINER_HOW, inputs=TrainingInputs,
                after=("base_model", "gate", "tokenize"), evaluated=True, advances_model=True,
                imports=TRANSFORMERS,
                headline=("final_loss", "tokens_per_s", "mfu"))
STEP_KINDS = (KIND,)
