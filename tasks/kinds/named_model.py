"""`what.models`: checkpoints from outside this run that steps name as `model:<name>` (the strong and weak answerers
of preference pairs, distillation teachers). Each is a step of its own, copied into the store as the starting
checkpoint is (tasks/kinds/base_model.py): the steps that read it find it on the shared store like any artifact,
its lineage names where it came from, and a model replaced under the same name is copied again. They are not
models of this run: never evaluated, never a `previous` or `final`."""

from __future__ import annotations

from compass.specs.starting_model import NAMED_MODEL_PREFIX
from compass.tasks.kinds.base_model import BaseModelConfig, run_base_model
from compass.tasks.kinds.gate import gate_inputs
from compass.tasks.steps.kind import TRANSFORMERS, PlanBuilder, StepKind
from compass.tasks.steps.placement import phase


def build(plan: PlanBuilder) -> None:
    for name, model in plan.spec.what.models.items():
        if model.resolved is None:
            raise ValueError("what.models was not resolved: load the spec with compass.specs.loader")
        config = BaseModelConfig(init_from=model.init_from, revision=model.revision, stamp=model.resolved.stamp,
                                 location=model.resolved.location)
        plan.add(KIND, name, config, gate_inputs(plan))


KIND = StepKind(NAMED_MODEL_PREFIX.rstrip(":"), BaseModelConfig, run_base_model, build, version="1",
                resources=phase("data"), imports=TRANSFORMERS)
STEP_KINDS = (KIND,)
