"""Long-context extension stages: continue from the previous stage at a longer sequence length and a larger RoPE
base, on a mixture that upweights long documents, which the packer keeps whole. NoPE layers and intra-document
masking carry over (same architecture and masking); YaRN or linear scaling for lengths beyond the trained one
is written into the exported config."""

from __future__ import annotations

from compass.infra.layout import CONTINUED_PARTS
from compass.model.training.history import tokens_seen
from compass.model.training.job import StageRecipe
from compass.specs.architecture import Architecture
from compass.specs.training import LongContextStage, Monitors, Optimizer, PretrainStage, Schedule, Yarn
from compass.tasks.common.continuation import continuation, inference_scaling
from compass.tasks.common.inputs import TrainingInputs, training_inputs
from compass.tasks.common.training import build_job, train_and_export
from compass.tasks.steps.context import StepContext, StepResult
from compass.tasks.steps.kind import MODEL_TRAINER_HOW, TRANSFORMERS, PlanBuilder, StepKind
from compass.tasks.steps.placement import phase
from compass.tasks.steps.step_config import StepConfig


class LongContextConfig(StepConfig):
    stage: LongContextStage
    inference_scaling: Yarn | None
    intra_document_masking: bool
    architecture: Architecture
    optimizer: Optimizer
    seed: int
    monitors: Monitors
    previous_length: int  # the context before this stage: longer documents are packed whole

    def sets_how(self) -> frozenset[str]:
        return frozenset({"parallelism.micro_batch_size"} if self.stage.micro_batch_size is not None else ())

    def recipe(self) -> StageRecipe:
        """One stage with its own length, RoPE base, budget, mixture and LR schedule."""
        s = self.stage
        stage = PretrainStage(name=s.name, tokens=s.tokens, sequence_length=s.sequence_length,
                              global_batch_size=s.global_batch_size, mixture=s.mixture)
        schedule = Schedule(kind=s.schedule, warmup_steps=s.warmup_steps, decay_fraction=s.decay_fraction)
        return continuation(self.architecture, self.optimizer, self.seed, self.intra_document_masking,
                            self.monitors, stage, rope_theta=s.rope_theta, lr=s.lr, schedule=schedule)


def build(plan: PlanBuilder) -> None:
    what = plan.spec.what
    pt, lc = what.pretraining, what.long_context
    trained = plan.of_kind("pretrain") or plan.of_kind("base_model")
    if not trained or not lc.stages:
        return
    previous = trained[-1].ref
    previous_length = what.trained_length
    for stage in lc.stages:
        config = LongContextConfig(stage=stage, inference_scaling=lc.inference_scaling,
                                   intra_document_masking=pt.intra_document_masking, architecture=what.architecture,
                                   optimizer=pt.optimizer, seed=pt.seed, monitors=pt.monitors,
                                   previous_length=previous_length)
        previous = plan.add(KIND, stage.name, config, training_inputs(plan, stage.mixture, previous))
        previous_length = stage.sequence_length


def run_long_context(ctx: StepContext[LongContextConfig]) -> StepResult:
    cfg = ctx.config
    stage = cfg.stage
    continued = ctx.given(TrainingInputs).previous
    job = build_job(ctx, cfg.recipe(), whole_from=cfg.previous_length,
                    tokens_before=(tokens_seen(continued.local(*CONTINUED_PARTS)) or 0) if continued else 0,
                    micro_batch_size=stage.micro_batch_size)
    export = inference_scaling(cfg.inference_scaling, stage.sequence_length, stage.rope_theta)
    result = train_and_export(ctx, job, "long-context", export)
    result.metrics.update({"sequence_length": stage.sequence_length, "rope_theta": stage.rope_theta})
    return result


# 2: the stage's WSD decay follows its decay_fraction (it was a hidden 0.2); 3: the training core of pretrain 2
KIND = StepKind("long_context", LongContextConfig, run_long_context, build, version="5",
                resources=phase("long_context"),
                trains=True, imports=TRANSFORMERS, reads_how=MODEL_TRAINER_HOW,
                inputs=TrainingInputs,
                after=("pretrain", "base_model", "tokenize"), evaluated=True, advances_model=True,
                headline=("final_loss", "tokens_per_s", "mfu"))
STEP_KINDS = (KIND,)
