"""A post-training dataset is checked before anything runs (issue 45, item 1): a local dataset that is missing, or
whose lines are of a shape compass does not read, or that holds fewer examples than its step draws, is a located
error naming the dataset, the first line of another shape and the shapes accepted, instead of TRL's bare
StopIteration after every earlier step. TRL's own prompt/completion lines are conversations."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from compass.flows.validation import load_checked
from compass.specs.loader import SpecError
from tests.conftest import write_minimal_spec

CHAT = {"messages": [{"role": "user", "content": "Hi?"}, {"role": "assistant", "content": "Hello."}]}
COMPLETION = {"prompt": "2 + 2 =", "completion": "4"}
PAIR = {"prompt": "Say hi.", "chosen": "Hi!", "rejected": "No."}


def spec_with(tmp_path: Path, step: str) -> Path:
    return write_minimal_spec(tmp_path, **{"  pretraining:": f"  post_training:\n    - {step}\n  pretraining:"})


def dataset(tmp_path: Path, rows: list[dict]) -> Path:
    folder = tmp_path / "chat"
    folder.mkdir(exist_ok=True)
    (folder / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder


def refused(spec: Path) -> str:
    with pytest.raises(SpecError) as info:
        load_checked(spec)
    (problem,) = info.value.problems
    assert problem.path == "what.post_training[0].dataset" and problem.line == 45, str(problem)  # the step's line
    return str(problem)


def test_a_missing_or_misshapen_sft_dataset_is_refused_before_anything_runs(tmp_path: Path):
    sft = "{method: sft, name: sft, dataset: DATA, lr: 1.0e-3, max_samples: 3}"
    assert "'" + str(tmp_path / "nowhere") + "' does not exist" in refused(
        spec_with(tmp_path, sft.replace("DATA", str(tmp_path / "nowhere"))))

    folder = dataset(tmp_path, [CHAT, {"question": "2 + 2?", "answer": "4"}, {"text": "a document"}])
    problem = refused(spec_with(tmp_path, sft.replace("DATA", str(folder))))
    assert f"'{folder}' holds 1 conversations of the 3 its step reads, in 3 lines" in problem
    assert "the first line that is not one: data.jsonl:2 (keys question, answer)" in problem
    assert '{"prompt": ..., "completion": ...}' in problem and '{"messages": [' in problem  # the shapes read

    dataset(tmp_path, [CHAT, COMPLETION, CHAT])  # TRL's prompt/completion lines are conversations
    load_checked(spec_with(tmp_path, sft.replace("DATA", str(folder))))


def test_prompt_completion_lines_are_read_as_conversations(tmp_path: Path):
    from compass.tasks.post_training.datasets import chat_examples

    folder = dataset(tmp_path, [COMPLETION, {"prompt": [{"role": "user", "content": "Hi?"}], "completion": "Hello."}])
    assert sorted(map(str, chat_examples(folder, None, seed=0, max_chars=1000))) == sorted(map(str, [
        [{"role": "user", "content": "2 + 2 ="}, {"role": "assistant", "content": "4"}],
        [{"role": "user", "content": "Hi?"}, {"role": "assistant", "content": "Hello."}]]))


def test_a_preference_dataset_without_pairs_is_refused_with_the_pair_shape(tmp_path: Path):
    folder = dataset(tmp_path, [CHAT, CHAT])
    dpo = f"{{method: dpo, name: dpo, dataset: {folder}, lr: 1.0e-6}}"
    problem = refused(spec_with(tmp_path, dpo))
    assert "holds 0 preference pairs of the 1 its step reads" in problem and "data.jsonl:1 (keys messages)" in problem
    assert '{"prompt": ..., "chosen": ..., "rejected": ...}' in problem
    dataset(tmp_path, [PAIR])
    load_checked(spec_with(tmp_path, dpo))
