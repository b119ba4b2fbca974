"""Preference pairs beyond strong-versus-weak: on-policy samples graded by a verifier (a correct answer is
chosen, an incorrect one rejected), and pairs read from a dataset that already has them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from compass.specs.post_training import DATASET_FILES
from compass.tasks.common.arithmetic import arithmetic_reward, exact_answer_reward
from compass.tasks.common.devices import Device
from compass.tasks.post_training.chat import generate, load_chat_model
from compass.tasks.post_training.datasets import is_pair_row

Pair = dict[str, Any]


def grade(verifier: str, problem: dict[str, str], completion: str) -> float:
    if verifier == "arithmetic":
        return arithmetic_reward(problem["question"], completion)
    return exact_answer_reward(problem["answer"], completion)


def pairs_from_grades(problems: list[dict[str, str]], samples: list[list[str]], verifier: str) -> list[Pair]:
    """For each problem, the first sample the verifier accepts (chosen) against the first it rejects
    (rejected); problems whose samples are all right or all wrong give no pair."""
    pairs = []
    for problem, answers in zip(problems, samples, strict=True):
        graded = [(grade(verifier, problem, a), a) for a in answers]
        good = [a for r, a in graded if r >= 1.0]
        bad = [a for r, a in graded if r < 1.0]
        if good and bad:
            pairs.append({"prompt": [{"role": "user", "content": problem["question"]}],
                          "chosen": [{"role": "assistant", "content": good[0]}],
                          "rejected": [{"role": "assistant", "content": bad[0]}]})
    return pairs


def on_policy_pairs(model_dir: Path, problems: list[dict[str, str]], samples_per_prompt: int, verifier: str,
                    max_new_tokens: int, seed: int, where: Device | None = None) -> list[Pair]:
    """Sample each problem `samples_per_prompt` times from the model being trained (on the step's GPU when it has
    one), grade, pair."""

    model, tokenizer = load_chat_model(model_dir, where)
    conversations = [[{"role": "user", "content": p["question"]}] for p in problems for _ in range(samples_per_prompt)]
    flat = generate(model, tokenizer, conversations, max_new_tokens=max_new_tokens, seed=seed)
    grouped = [flat[i * samples_per_prompt:(i + 1) * samples_per_prompt] for i in range(len(problems))]
    return pairs_from_grades(problems, grouped, verifier)


def dataset_pairs(root: Path, limit: int | None) -> list[Pair]:
    """Pairs from JSONL lines with `prompt`, `chosen` and `rejected` (strings or chat messages)."""
    pairs: list[Pair] = []
    for path in sorted(root.rglob(DATASET_FILES)):
        with open(path, encoding="utf-8", errors="replace") as f:
            for line in f:
                try:
                    row = json.loads(line)
                except ValueError:
                    continue
                if is_pair_row(row):
                    pairs.append({k: _as_messages(row[k], "user" if k == "prompt" else "assistant")
                                  for k in ("prompt", "chosen", "rejected")})
                    if limit and len(pairs) >= limit:
                        return pairs
    return pairs


def _as_messages(value: Any, role: str) -> list[dict[str, str]]:
    if isinstance(value, list):
        return [{"role": m["role"], "content": m["content"]} for m in value]
    return [{"role": role, "content": str(value)}]
