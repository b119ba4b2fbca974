"""A `kind: hub` tokenizer candidate (SmolLM3's only one) is read from the local Hugging Face cache: refused
before anything runs when it is not there, and selected, tokenized with and trained on when it is."""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

import pytest

from compass.flows.runner import run_in_process
from compass.flows.validation import load_checked
from compass.infra.store import Store
from compass.specs.loader import SpecError
from compass.tasks.steps.context import Runtime
from tests.conftest import FIXTURES, seeded, write_minimal_spec
from tests.hub_cache import seed_model

REPO_ID = "test-org/tiny-bpe"
HUB_CANDIDATE = f"      - {{kind: hub, repo: {REPO_ID}, vocab_size: 320}}"
CANDIDATES = "      - {kind: bpe, vocab_size: 300}\n      - {kind: bpe, vocab_size: 400}"


def published_tokenizer(folder: Path) -> Path:
    """A tokenizer trained here and saved the way a hub repository holds one."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    texts = [p.read_text() for p in sorted((FIXTURES / "corpus" / "en").glob("*.txt"))]
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=320, special_tokens=["<|end_of_text|>"],
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|end_of_text|>", bos_token="<|end_of_text|>"
                            ).save_pretrained(str(folder))
    return folder


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_hub_candidate_missing_from_the_cache_is_refused_before_anything_runs(tmp_path: Path,
                                                                            monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    spec = write_minimal_spec(tmp_path, **{CANDIDATES: HUB_CANDIDATE})
    with pytest.raises(SpecError) as info:
        load_checked(spec)
    (problem,) = info.value.problems
    assert problem.path == "what.tokenizer.candidates[0].repo" and problem.line == 19
    assert f"'{REPO_ID}' (revision main) is not in the local Hugging Face cache" in problem.message
    assert f"hf download {REPO_ID}" in problem.hint and str(tmp_path / "empty-cache") in problem.hint


def test_hub_candidate_from_the_cache_is_chosen_tokenizes_and_trains(data_store: Path, tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch):
    cache = tmp_path / "hub-cache"
    snapshot = seed_model(cache, REPO_ID, published_tokenizer(tmp_path / "published"))
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    spec = write_minimal_spec(tmp_path, **{CANDIDATES: HUB_CANDIDATE})
    checked = load_checked(spec)
    store = Store(str(seeded(tmp_path / "store", data_store)))  # the documents curated: the tokenizer differs
    plan = checked.plan.up_to(["pretrain:stage1"])
    outcomes = run_in_process(plan, store, checked.loaded.spec_hash,
                              Runtime(how=checked.spec.how, base_dir=checked.loaded.base_dir),
                              logging.getLogger("test"))
    selection = Path(outcomes["tokenizer:select"].uri)
    comparison = json.loads((selection / "comparison.json").read_text())
    assert comparison["chosen"] == "test-org--tiny-bpe"
    assert sha(selection / "chosen" / "tokenizer.json") == sha(snapshot / "tokenizer.json")
    meta = json.loads((Path(outcomes["tokenize:notes"].uri) / "meta.json").read_text())
    assert meta["eos"] == json.loads((snapshot / "tokenizer.json").read_text())["model"]["vocab"]["<|end_of_text|>"]
    trained = outcomes["pretrain:stage1"].manifest.metrics
    assert trained["final_loss"] < trained["first_loss"]


def test_a_hub_candidate_whose_cached_vocabulary_differs_is_refused_and_a_smoke_run_reports_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """The planner sizes the embedding and its costs from the declared vocabulary: a full run refuses a cached
    tokenizer of another size; a smoke run takes the cached one (a stand-in is what a laptop has) and says so."""
    from compass.flows.reports.smoke import smoke_table

    cache = tmp_path / "hub-cache"
    seed_model(cache, REPO_ID, published_tokenizer(tmp_path / "published"))
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    spec = write_minimal_spec(tmp_path, **{CANDIDATES: HUB_CANDIDATE.replace("vocab_size: 320", "vocab_size: 4096")})
    with pytest.raises(SpecError) as info:
        load_checked(spec)
    (problem,) = info.value.problems
    assert problem.path == "what.tokenizer.candidates[0].vocab_size" and problem.line == 19
    assert f"declares 4096 tokens, and the cached tokenizer '{REPO_ID}' (revision main" in problem.message
    assert "has 320" in problem.message and problem.hint.startswith("set vocab_size: 320")

    smoke = load_checked(spec, size="smoke")
    (candidate,) = smoke.spec.what.tokenizer.candidates
    assert candidate.vocab_size == 320
    rows = {r["step"]: r for r in smoke_table(smoke.plan, smoke.spec, smoke.loaded.size_changes)}
    assert "candidates[0].vocab_size 4096 -> 320 (the cached tokenizer's)" in rows["tokenizer:select"]["shrunk"]
