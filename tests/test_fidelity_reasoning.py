"""Hybrid reasoning: one template, two modes chosen by /think and /no_think in the system prompt; the tokens SFT
trained on equal what `tokenizer.apply_chat_template` renders (so inference engines reproduce training); the
generation prompt of each mode is exactly where its training examples continue; a system prompt lost between the
data and the tokens fails the step."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import REPO, run_up_to, seeded, write_minimal_spec

CONVERSATION = [{"role": "user", "content": "What is 12 + 7 * 2?"},
                {"role": "assistant", "content": "<think>\n7 * 2 = 14\n12 + 14 = 26\n</think>\n26"}]


@pytest.fixture(scope="module")
def tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from compass.tasks.post_training.chat import IM_END, IM_START
    from compass.tasks.post_training.reasoning import HYBRID_TEMPLATE

    texts = [p.read_text() for p in sorted((REPO / "tests" / "fixtures" / "corpus").rglob("*.txt"))]
    bpe = Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>", IM_START, IM_END],
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, unk_token="<unk>", eos_token=IM_END, pad_token=IM_END)
    tok.chat_template = HYBRID_TEMPLATE
    return tok


@pytest.mark.parametrize("mode", ["/think", "/no_think"])
def test_each_mode_continues_from_its_generation_prompt_and_trains_only_the_answer(tokenizer, mode: str):
    from compass.tasks.post_training.reasoning import EMPTY_THINK, with_mode

    conversation = with_mode(CONVERSATION, mode, system="You are helpful.")
    assert conversation[0] == {"role": "system", "content": f"You are helpful.\n{mode}"}
    prompt = tokenizer.apply_chat_template(conversation[:-1], add_generation_prompt=True, tokenize=False)
    full = tokenizer.apply_chat_template(conversation, tokenize=False)
    assert full.startswith(prompt)  # inference starts exactly where training continued
    assert prompt.endswith(EMPTY_THINK) == (mode == "/no_think")
    rendered = tokenizer.apply_chat_template(conversation, tokenize=True, return_dict=True,
                                             return_assistant_tokens_mask=True)
    trained = [t for t, m in zip(rendered["input_ids"], rendered["assistant_masks"], strict=True) if m]
    assert tokenizer.decode(trained) == CONVERSATION[1]["content"] + "<|im_end|>"  # the empty block is not trained


def test_worked_steps_compute_what_the_verifier_checks():
    from compass.tasks.common.arithmetic import arithmetic_reward
    from compass.tasks.post_training.reasoning import reasoning_conversations, worked_steps

    assert worked_steps("12 + 7 * 2") == (["7 * 2 = 14", "12 + 14 = 26"], "26")
    assert worked_steps("(3 - 5) * 4") == (["3 - 5 = -2", "-2 * 4 = -8"], "-8")
    assert worked_steps("import os") is None
    (conversation,) = reasoning_conversations([{"question": "12 + 7 * 2 =", "answer": "26"}])
    answer = conversation[-1]["content"].split("</think>\n")[1]
    assert conversation[0]["content"] == "/think" and arithmetic_reward("12 + 7 * 2 =", answer) == 1.0


def test_a_system_prompt_lost_on_the_way_to_the_tokens_fails(tokenizer):
    from compass.infra.errors import DataError
    from compass.tasks.post_training.reasoning import rendered_ids, system_prompts_kept, with_mode

    conversations = [with_mode(CONVERSATION, "/no_think", system="Answer in French.")]
    kept = [rendered_ids(tokenizer, c) for c in conversations]
    system_prompts_kept(conversations, kept, tokenizer)
    # the playbook's bug: a template (or a pipeline step) that leaves system messages out
    dropping = tokenizer.chat_template.replace("{%- for message in messages -%}",
                                               "{%- for message in messages if message['role'] != 'system' -%}")
    assert dropping != tokenizer.chat_template
    lost = [rendered_ids(tokenizer, c, chat_template=dropping) for c in conversations]
    with pytest.raises(DataError, match="1 of 1 conversations lost their system prompt"):
        system_prompts_kept(conversations, lost, tokenizer)


SFT = """  post_training:
    - {method: sft, name: hybrid, dataset: "pypi://evals==3.0.1.post1", lr: 1.0e-3, max_samples: 40, max_length: 256,
       batch_size: 8, reasoning: {think_fraction: 0.5}}
  evaluation:
    vibe_prompts: ["What is 3 + 4?"]
  pretraining:"""


@pytest.mark.slow
def test_hybrid_sft_trains_both_modes_on_the_tokens_the_template_renders(trained_store: Path, tmp_path: Path):
    from transformers import AutoTokenizer

    spec = write_minimal_spec(tmp_path, **{"  pretraining:": SFT})
    _, outcomes = run_up_to(spec, "post_train:hybrid", seeded(tmp_path / "store", trained_store))
    outcome = outcomes["post_train:hybrid"]
    out = Path(outcome.uri)
    assert outcome.manifest.metrics["think_examples"] == 20 and outcome.manifest.metrics["examples"] == 40
    exported = AutoTokenizer.from_pretrained(str(out / "final"))
    assert "/no_think" in exported.chat_template  # saved with the model: what inference engines render
    samples = [json.loads(line) for line in (out / "sft_samples.jsonl").read_text().splitlines()]
    modes = {s["messages"][0]["content"].rsplit("\n", 1)[-1] for s in samples}
    assert modes == {"/think", "/no_think"}
    from compass.tasks.post_training.reasoning import rendered_ids

    for sample in samples:  # token by token
        assert rendered_ids(exported, sample["messages"]) == sample["input_ids"]
    vibes = json.loads((out / "vibe_check.json").read_text())
    assert [(v["prompt"], v["mode"]) for v in vibes] == [("What is 3 + 4?", "/think"), ("What is 3 + 4?", "/no_think")]
