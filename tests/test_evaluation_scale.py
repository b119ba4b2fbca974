"""Evaluation at long context without the memory of full-vocabulary logits: passkey reads the prompt once into the
KV cache and scores only the answer tokens."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parent.parent

PEAK_GROWTH = """
import json, re, sys
from pathlib import Path
import numpy as np, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from compass.tasks.evaluation.retrieval import passkey_cells

folder, length = Path(sys.argv[1]), int(sys.argv[2])
torch.set_num_threads(1)
tokenizer = AutoTokenizer.from_pretrained(str(folder))
model = AutoModelForCausalLM.from_pretrained(str(folder)).eval()
text = " ".join(p.read_text() for p in sorted(Path(sys.argv[3]).rglob("*.txt")))
haystack = np.asarray(tokenizer.encode(text, add_special_tokens=False))


def kib(field):
    return int(re.search(rf"{field}:\\s+(\\d+)", Path("/proc/self/status").read_text()).group(1))


def peak_growth_mib(work):
    Path("/proc/self/clear_refs").write_text("5")  # resets the peak resident size (VmHWM) to the current one
    before = kib("VmRSS")
    work()
    return (kib("VmHWM") - before) / 1024


def forward():
    with torch.no_grad():
        model(input_ids=torch.tensor([np.resize(haystack, length).tolist()]))


forward()  # warm: kernels and allocator
print(json.dumps({"forward": peak_growth_mib(forward),
                  "passkey": peak_growth_mib(lambda: passkey_cells(model, tokenizer, haystack, [length], [0.5], 1))}))
"""


def peak_growth_mib(folder: Path, length: int) -> dict[str, float]:
    """Peak resident memory added by one forward pass and by one passkey sample at `length` tokens, read from the
    kernel's high-water mark (reset before each) with a fixed malloc mmap threshold, so freed memory goes back to
    the system and the mark follows live memory."""
    done = subprocess.run([sys.executable, "-c", PEAK_GROWTH, str(folder), str(length),
                           str(REPO / "tests" / "fixtures" / "corpus")], capture_output=True, text=True, cwd=REPO,
                          timeout=300, env={**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"})
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_passkey_at_8k_tokens_stays_within_twice_one_forward_pass(tmp_path: Path):
    """Scoring five candidate keys after an 8k-token haystack costs about one forward pass over it: the prompt is
    read once without logits, not once per candidate with full-vocabulary logits (which took ~8x here)."""
    from tests.hub_cache import tiny_llama

    peaks = peak_growth_mib(tiny_llama(tmp_path / "tiny"), 8192)
    assert peaks["forward"] > 1, peaks  # the measure sees the forward pass at all
    assert peaks["passkey"] <= 2 * peaks["forward"], peaks


def test_chunked_prompt_scores_as_one_pass(tmp_path: Path):
    """Reading the prompt into the cache in chunks gives the candidates the scores of one pass (beyond 32k tokens
    passkey reads in chunks), and each candidate is cropped off so the next one sees the prompt alone."""
    import torch
    from transformers import AutoModelForCausalLM

    from compass.tasks.evaluation.retrieval import score_candidates
    from tests.hub_cache import tiny_llama

    model = AutoModelForCausalLM.from_pretrained(str(tiny_llama(tmp_path / "tiny"))).eval()
    rng = np.random.default_rng(0)
    prompt = rng.integers(3, 300, size=300).tolist()
    candidates = [rng.integers(3, 300, size=n).tolist() for n in (1, 3, 2, 3)]
    whole = score_candidates(model, prompt, candidates)
    chunked = score_candidates(model, prompt, candidates, chunk=64)
    assert chunked == pytest.approx(whole, abs=1e-4)
    with torch.no_grad():  # the reference: every candidate appended to the prompt, one full forward each
        for cand, got in zip(candidates, whole, strict=True):
            logprobs = model(input_ids=torch.tensor([prompt + cand])).logits[0].log_softmax(-1)
            expected = sum(float(logprobs[len(prompt) - 1 + i, t]) for i, t in enumerate(cand))
            assert got == pytest.approx(expected, abs=1e-4)
