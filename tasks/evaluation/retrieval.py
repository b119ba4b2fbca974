"""Passkey retrieval (needle in a haystack) built from real held-out corpus text: a five-digit key is hidden
at a given depth of a context of a given length, and the model must rank the true key above four distractors
by likelihood after "What is the pass key?". Chance is 20%. Measured at every trained length, before and
after each long-context stage, so the report shows where extension made long contexts usable."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

CANDIDATES = 5
NEEDLE = " The pass key is {key}. Remember it."
QUESTION = " What is the pass key? The pass key is"


def build_prompt(haystack: np.ndarray, needle: list[int], question: list[int], length: int, depth: float,
                 rng: np.random.Generator, reserve: int) -> tuple[list[int], int]:
    """Context of `length` tokens minus `reserve` (for the answer): haystack text with the needle inserted at
    `depth` (0 = start, 1 = just before the question). Returns (token ids, the needle's offset)."""
    budget = length - len(needle) - len(question) - reserve
    if budget <= 0:
        raise ValueError(f"length {length} leaves no room for a haystack")
    if len(haystack) < budget:
        haystack = np.resize(haystack, budget)  # repeat the held-out text
    start = int(rng.integers(0, len(haystack) - budget + 1))
    hay = haystack[start:start + budget].tolist()
    at = int(round(depth * budget))
    return hay[:at] + needle + hay[at:] + question, at


@torch.no_grad()
def score_candidates(model: torch.nn.Module, prompt: list[int], candidates: list[list[int]],
                     pad_id: int) -> list[float]:
    """Sum of log-probabilities of each candidate continuation, one batched forward pass."""
    width = len(prompt) + max(len(c) for c in candidates)
    rows = [prompt + c + [pad_id] * (width - len(prompt) - len(c)) for c in candidates]
    logits = model(input_ids=torch.tensor(rows)).logits.float().log_softmax(-1)
    scores = []
    for i, cand in enumerate(candidates):
        positions = torch.arange(len(prompt) - 1, len(prompt) - 1 + len(cand))
        scores.append(float(logits[i, positions, torch.tensor(cand)].sum()))
    return scores


def passkey_accuracy(model_dir: Path, haystack: np.ndarray, lengths: list[int], depths: list[float],
                     samples: int, seed: int = 0) -> list[dict[str, Any]]:
    """Accuracy per (length, depth) of the model saved in `model_dir`, the same prompts for every checkpoint."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir)).eval()
    return passkey_cells(model, tokenizer, haystack, lengths, depths, samples, seed)


def passkey_cells(model: torch.nn.Module, tokenizer: Any, haystack: np.ndarray, lengths: list[int],
                  depths: list[float], samples: int, seed: int = 0) -> list[dict[str, Any]]:
    """Accuracy per (length, depth) (fixed seed: the same prompts for every model). A sample counts as correct
    only when the true key scores strictly above every distractor: a model that cannot tell them apart (equal
    scores) is wrong, not lucky."""
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    question = tokenizer.encode(QUESTION, add_special_tokens=False)
    out = []
    for length in lengths:
        if length < 2 * (len(question) + len(tokenizer.encode(NEEDLE.format(key=10000), add_special_tokens=False))):
            continue  # too short for a haystack worth the name: not measured
        for depth in depths:
            rng = np.random.default_rng([seed, length, int(depth * 1000)])
            correct = 0
            for _ in range(samples):
                keys = rng.choice(np.arange(10000, 100000), size=CANDIDATES, replace=False)
                needle = tokenizer.encode(NEEDLE.format(key=keys[0]), add_special_tokens=False)
                candidates = [tokenizer.encode(f" {k}", add_special_tokens=False) for k in keys]
                prompt, _ = build_prompt(haystack, needle, question, length, depth, rng,
                                         reserve=max(len(c) for c in candidates))
                scores = score_candidates(model, prompt, candidates, pad)
                correct += int(scores[0] > max(scores[1:]))
            out.append({"length": length, "depth": depth, "accuracy": correct / samples, "samples": samples})
    return out
