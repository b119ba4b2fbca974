"""The post-training methods TRL trains, one record each: what the planner (specs/costs.py), the checks
(specs/checks.py), the post_train kind, the TRL ranks and the smoke report know of a method.

A method is a value of a section's `method` literal (specs/post_training.py) and its record here. The record holds
facts only: TRL's classes are named as `module:Class` (specs imports no library), and the callables that build a
method's rows and its trainer live in tasks/, keyed by the record's `section` (one builder per section model:
tasks/kinds/post_train.py `CONFIGS` and `ROWS`, tasks/post_training/trl_ranks.py `TRAINERS`). A method inside an
existing family (SimPO among the preference methods) is its literal value and its record, nothing else; the
trainer builder reads `trl_config`, `trl_trainer`, `reads`, `fixed`, `reference_model` and `splits_pairs` from
here, so the frozen models the planner counts are the ones the builder hands TRL (tests/test_post_training_methods.py
compares both with what each TRL trainer holds)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from compass.specs.post_training import Distillation, Grpo, Preference, Sft

TrlSectionModel = type[Sft] | type[Preference] | type[Grpo] | type[Distillation]


@dataclass(frozen=True)
class PostTrainingMethod:
    """One TRL post-training method."""

    name: str  # the spec's `method`
    section: TrlSectionModel  # its section model: the family whose config, rows and trainer builder it uses
    label: str  # what the smoke report says a step of it exercised
    trl_config: str  # TRL's config class, `module:Class`
    trl_trainer: str  # TRL's trainer class, `module:Class`
    reads: tuple[str, ...] = ()  # fields of its section that only some methods of the family read, handed to TRL's
    # config under the same name when set (validation refuses the family's others on this method)
    fixed: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))  # arguments of TRL's config the
    # method fixes
    paired: bool = False  # its rows are prompt/chosen/rejected pairs (the dataset's, strong_vs_weak or verifier)
    splits_pairs: bool = False  # each pair trains as one desirable and one undesirable completion (KTO)
    # memory terms (specs/costs.py library_step_memory)
    reference_model: bool = False  # a frozen copy of the start model beside the trained one; none under LoRA,
    # where TRL disables the adapter for the reference pass instead
    teacher: bool = False  # a frozen teacher beside the student (its size from what.models, else the student's)
    sequences_per_row: int = 1  # sequences a micro-batch row puts through the model (chosen and rejected; KTO: the
    # completion and its mismatched KL completion)
    fused_loss: bool = True  # how.loss liger spares the full-vocabulary logits (the trainer hands the model its
    # labels); false: the trainer computes log-probabilities from the full logits itself
    logits_copies: int = 1  # full-vocabulary logits held at once per sequence (GKD: the student's and the teacher's)

    def frozen_models(self, lora: bool) -> int:
        """Frozen copies of the start model beside the trained one (the teacher is counted apart: its size may
        differ)."""
        return int(self.reference_model and not lora)


_PAIRS: dict[str, Any] = dict(section=Preference, paired=True, sequences_per_row=2)

METHODS: Mapping[str, PostTrainingMethod] = MappingProxyType({m.name: m for m in (
    PostTrainingMethod("sft", Sft, "TRL SFT", "trl:SFTConfig", "trl:SFTTrainer"),
    PostTrainingMethod("dpo", label="TRL DPO", trl_config="trl:DPOConfig", trl_trainer="trl:DPOTrainer",
                       reads=("loss_type",), reference_model=True, **_PAIRS),
    # ORPO has no reference model ("Monolithic Preference Optimization without Reference Model"); its trainer
    # computes log-probabilities from the model's full logits, with Liger or without
    PostTrainingMethod("orpo", label="TRL ORPO", trl_config="trl.experimental.orpo:ORPOConfig",
                       trl_trainer="trl.experimental.orpo:ORPOTrainer", fused_loss=False, **_PAIRS),
    PostTrainingMethod("kto", label="TRL KTO", trl_config="trl:KTOConfig", trl_trainer="trl:KTOTrainer",
                       splits_pairs=True, reference_model=True, **_PAIRS),
    # SimPO: CPO's trainer with the SimPO loss and no behaviour-cloning term (TRL's recipe), reference-free
    PostTrainingMethod("simpo", label="TRL SimPO (CPOTrainer)", trl_config="trl.experimental.cpo:CPOConfig",
                       trl_trainer="trl.experimental.cpo:CPOTrainer", reads=("simpo_gamma",),
                       fixed=MappingProxyType({"loss_type": "simpo", "cpo_alpha": 0.0}), fused_loss=False, **_PAIRS),
    # GRPO's reference model exists only with TRL's beta > 0; compass leaves it at TRL's 0.0
    PostTrainingMethod("grpo", Grpo, "TRL GRPO", "trl:GRPOConfig", "trl:GRPOTrainer"),
    PostTrainingMethod("distill", Distillation, "TRL GKD", "trl.experimental.gkd:GKDConfig",
                       "trl.experimental.gkd:GKDTrainer", teacher=True, fused_loss=False, logits_copies=2),
)})


def method_of(step: Sft | Preference | Grpo | Distillation) -> PostTrainingMethod:
    """The record of a TRL step's method (mid-training is not one: it runs on compass's trainer)."""
    try:
        return METHODS[step.method]
    except KeyError:
        raise ValueError(f"post-training method {step.method!r} has no record in specs/post_training_methods.py "
                         f"(known: {', '.join(METHODS)})") from None


def family_reads(section: type) -> dict[str, tuple[str, ...]]:
    """Each field of a section model that only some of its methods read, and the methods that read it (DPO's
    loss_type, SimPO's simpo_gamma)."""
    readers: dict[str, tuple[str, ...]] = {}
    for method in METHODS.values():
        if issubclass(section, method.section):
            for name in method.reads:
                readers[name] = (*readers.get(name, ()), method.name)
    return readers


def with_reference_model() -> list[str]:
    """The methods whose trainer holds a frozen reference model beside the trained one."""
    return [m.name for m in METHODS.values() if m.reference_model]
