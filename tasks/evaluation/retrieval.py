"""Passkey retrieval (needle in a haystack) built from real held-out corpus text: a five-digit key is hidden
at a given depth of a context of a given length, and the model must rank the true key above four distractors
by likelihood after "What is the pass key?". Chance is 20%. Measured at every trained length, before and
after each long-context stage, so the report shows where extension made long contexts usable."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from compass.tasks.common.devices import Device

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


PREFILL_CHUNK = 32768  # prompt tokens per forward pass: one causal pass (no mask) up to 32k, bounded activations beyond


@torch.no_grad()
def score_candidates(model: torch.nn.Module, prompt: list[int], candidates: list[list[int]],
                     chunk: int = PREFILL_CHUNK) -> list[float]:
    """Sum of log-probabilities of each candidate continuation. The prompt is read once into the KV cache (in
    `chunk`-token passes beyond that length) with logits only at its last position; each candidate then extends
    the cache, gets logits at its own positions and is cropped off again. Peak memory is about one forward pass
    over the prompt: five padded rows of full-vocabulary logits would take ~168 GB at 64k for a 3B model."""
    device = _device_of(model)
    cache, out = None, None
    for start in range(0, len(prompt), chunk):
        ids = torch.tensor([prompt[start:start + chunk]], device=device)
        out = model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
        cache = out.past_key_values
    first = out.logits[0, -1].float().log_softmax(-1)
    scores = []
    for cand in candidates:
        score = float(first[cand[0]])
        if len(cand) > 1:
            rest = model(input_ids=torch.tensor([cand[:-1]], device=device), past_key_values=cache, use_cache=True)
            logprobs = rest.logits[0].float().log_softmax(-1)
            score += float(logprobs[torch.arange(len(cand) - 1), torch.tensor(cand[1:], device=device)].sum())
            cache.crop(-(len(cand) - 1))
        scores.append(score)
    return scores


def _device_of(model: torch.nn.Module) -> torch.device:
    return next((p.device for p in model.parameters()), torch.device("cpu"))


def passkey_accuracy(model_dir: Path, haystack: np.ndarray, lengths: list[int], depths: list[float],
                     samples: int, seed: int = 0, where: Device | None = None) -> list[dict[str, Any]]:
    """Accuracy per (length, depth) of the model saved in `model_dir`, the same prompts for every checkpoint, on the
    step's device (bf16 on a GPU when the spec trains in bf16)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    where = where or Device("cpu", bf16=False)
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=getattr(torch, where.dtype))
    model = model.to(where.device).eval()
    return passkey_cells(model, tokenizer, haystack, lengths, depths, samples, seed)


def passkey_cells(model: torch.nn.Module, tokenizer: Any, haystack: np.ndarray, lengths: list[int],
                  depths: list[float], samples: int, seed: int = 0) -> list[dict[str, Any]]:
    """Accuracy per (length, depth) (fixed seed: the same prompts for every model). A sample counts as correct
    only when the true key scores strictly above every distractor: a model that cannot tell them apart (equal
    scores) is wrong, not lucky."""
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
                scores = score_candidates(model, prompt, candidates)
                correct += int(scores[0] > max(scores[1:]))
            out.append({"length": length, "depth": depth, "accuracy": correct / samples, "samples": samples})
    return out
