"""What a post-training step draws from its dataset before it trains, as text, with the same readers and the same
seeds the step uses (tasks/kinds/post_train.py): what the decontamination fence scans, and what its `remove`
policy filters. Answers generated during the step (strong-versus-weak and on-policy pairs) answer prompts drawn here;
the prompts are what can carry a benchmark in."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from compass.specs.post_training import Distillation, Grpo, PostTrainStep, Preference, Sft
from compass.tasks.common.arithmetic import training_arithmetic

MAX_CHARS_PER_TOKEN = 3  # conversations longer than max_length * this many characters are left out
WHOLE_CHARS = 10**9  # a whole-dataset scan leaves no conversation out for its length
SFT_SEED, PAIRS_SEED, DISTILL_SEED = 0, 1, 2  # the seeds SFT, preference prompts and distillation draw with


@dataclass(frozen=True)
class Drawn:
    """One example: its place in the dataset's draw, its text, and whether it is a problem (compared item for item)."""

    position: int
    text: str
    problem: bool = False


def drawn(step: PostTrainStep, base_dir: Path, whole: bool = False) -> Iterator[Drawn]:
    """The examples `step` draws, in its order; `whole`: every example of its dataset (no cap on their number or
    length), in the same seeded order."""
    from compass.tasks.post_training.datasets import chat_examples, dataset_root

    root, _ = dataset_root(step.dataset, base_dir)
    limit = None if whole else step.max_samples
    if isinstance(step, Grpo) or (isinstance(step, Preference) and step.pairs and step.pairs.kind == "verifier"):
        for i, problem in enumerate(training_arithmetic(root, limit)):
            yield Drawn(i, problem["question"], problem=True)
        return
    if isinstance(step, Preference) and not step.pairs:
        from compass.tasks.post_training.pairs import dataset_pairs

        for i, pair in enumerate(dataset_pairs(root, limit)):
            yield Drawn(i, "\n".join(m["content"] for part in ("prompt", "chosen", "rejected") for m in pair[part]))
        return
    if isinstance(step, Sft | Preference | Distillation):
        seed = SFT_SEED if isinstance(step, Sft) else DISTILL_SEED if isinstance(step, Distillation) else PAIRS_SEED
        chars = WHOLE_CHARS if whole else step.max_length * MAX_CHARS_PER_TOKEN
        for i, messages in enumerate(chat_examples(root, limit, seed, chars)):
            yield Drawn(i, "\n".join(m["content"] for m in messages))
