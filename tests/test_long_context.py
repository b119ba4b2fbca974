"""Long-context extension: stages at longer lengths and larger RoPE bases continuing from pretraining, long
documents packed whole, YaRN written into the exported config, and passkey retrieval measured at every
length before and after extension."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import pytest
import torch

from compass.model.training.packing import PADDING, Packer
from compass.tasks.evaluation.retrieval import NEEDLE, QUESTION, build_prompt
from tests.conftest import REPO, seeded, write_minimal_spec

LONG_CONTEXT = """  long_context:
    stages:
      - {name: ctx128, sequence_length: 128, rope_theta: 40000, tokens: 4096, global_batch_size: 4,
         mixture: {notes: 1.0}, lr: 1.0e-3}
      - {name: ctx256, sequence_length: 256, rope_theta: 100000, tokens: 4096, global_batch_size: 2,
         micro_batch_size: 1, mixture: {notes: 1.0}, lr: 1.0e-3}
    inference_scaling: {kind: yarn, factor: 2.0}
    retrieval_depths: [0.1, 0.9]
    retrieval_samples: 4
  evaluation:
    perplexity_sources: [notes]
  pretraining:"""


class Docs:
    def __init__(self, lengths: list[int]):
        self.docs = [np.full(n, i + 1) for i, n in enumerate(lengths)]

    @property
    def n_documents(self) -> int:
        return len(self.docs)

    def document(self, i: int) -> np.ndarray:
        return self.docs[i]


def test_documents_longer_than_the_old_context_are_packed_whole():
    lengths = [10, 40, 70, 25, 90, 5, 64, 100, 33, 80, 150]  # old context 32, new 96
    source = Docs(lengths)
    packer = Packer({"d": source}, {"d": 1.0}, 96, seed=0, whole_from=32, pad_id=0)
    seen: dict[int, list[int]] = {}
    for _ in range(40):
        tokens, segments = packer.next_sequence()
        for seg in set(segments.tolist()) - {PADDING}:
            doc = int(tokens[segments == seg][0])
            seen.setdefault(doc, []).append(int((segments == seg).sum()))
        assert (tokens[segments == PADDING] == 0).all()
    for doc, pieces in seen.items():
        n = lengths[doc - 1]
        if 32 < n <= 96:  # whole: each appearance is the full document
            assert all(p == n for p in pieces), (n, pieces)
    assert any(len(p) > 1 and sum(p[:2]) == 150 for d, p in seen.items() if lengths[d - 1] == 150)  # still split
    plain = Packer({"d": source}, {"d": 1.0}, 96, seed=0)
    assert PADDING not in np.concatenate([plain.next_sequence()[1] for _ in range(10)])


def test_passkey_prompt_puts_the_needle_at_its_depth():
    hay = np.arange(1000, 3000)
    needle, question = [1, 2, 3], [7, 8]
    for depth in (0.0, 0.5, 1.0):
        prompt, at = build_prompt(hay, needle, question, 200, depth, np.random.default_rng(0), reserve=4)
        assert len(prompt) == 196 and prompt[at:at + 3] == needle and prompt[-2:] == question
        assert at == round(depth * (200 - 3 - 2 - 4))
    assert "{key}" in NEEDLE and QUESTION.endswith("pass key is")


@pytest.mark.slow
def test_extension_stages_export_yarn_and_measure_retrieval(trained_store: Path, tmp_path: Path):
    from transformers import AutoConfig, AutoModelForCausalLM

    from compass.flows.compiler import compile_spec
    from compass.flows.runner import RunContext, run_step
    from compass.infra.store import Store
    from compass.specs import load_spec
    from compass.tasks.steps.context import Runtime

    spec = write_minimal_spec(tmp_path, **{"  pretraining:": LONG_CONTEXT})
    loaded = load_spec(spec)
    plan = compile_spec(loaded.spec).restricted_to({"ingest", "curate", "tokenizer", "tokenize", "pretrain",
                                                    "long_context", "evaluate"})
    ctx = RunContext(plan, Store(str(seeded(tmp_path / "store", trained_store))), loaded.spec_hash,
                     Runtime(how=loaded.spec.how, base_dir=loaded.base_dir))
    done = {s.id: run_step(ctx, s, logging.getLogger("test")) for s in plan.steps}

    ext = Path(done["long_context:ctx256"].uri)
    config = json.loads((ext / "final" / "config.json").read_text())
    assert config["rope_parameters"] == {"rope_type": "yarn", "rope_theta": 100000.0, "factor": 2.0,
                                         "original_max_position_embeddings": 256}
    assert config["max_position_embeddings"] == 512 and config["no_rope_layers"] == [1, 1]
    assert AutoConfig.from_pretrained(str(ext / "final")).rope_parameters["rope_type"] == "yarn"
    AutoModelForCausalLM.from_pretrained(str(ext / "final"))  # loads with its scaling
    first = json.loads((Path(done["long_context:ctx128"].uri) / "final" / "config.json").read_text())
    assert first["rope_parameters"]["rope_theta"] == 40000.0

    rows = [json.loads(line) for line in (ext / "metrics.jsonl").read_text().splitlines()]
    assert [r["stage"] for r in rows][-1] == "ctx256" and {"stage1", "stage2", "ctx128"} <= {r["stage"] for r in rows}
    assert all(a["tokens"] < b["tokens"] for a, b in zip(rows, rows[1:], strict=False))  # tokens keep counting

    for model_step in ("pretrain-stage2", "long_context-ctx128", "long_context-ctx256"):
        metrics = done[f"evaluate:{model_step}"].manifest.metrics
        assert "passkey@64" not in metrics  # the needle and question leave too little haystack at 64
        for length in (128, 256):
            assert 0 <= metrics[f"passkey@{length}"] <= 1
            assert {f"passkey@{length}/depth0.1", f"passkey@{length}/depth0.9"} <= set(metrics)
        assert metrics["val_ppl:notes"] > 1


class InContextCopier(torch.nn.Module):
    """A model that must pass passkey: at each position it predicts the token that followed the most recent earlier
    occurrence of the last four tokens (an induction head written out), so after "The pass key is" it copies the
    key from the needle, wherever the needle sits. It keeps its context in a cache it can crop, as transformers'
    models do, so it is read the way passkey reads a real model (chunked prompt, answer positions only)."""

    class Context:
        def __init__(self, ids: list[int]):
            self.ids = ids

        def crop(self, tokens_to_remove: int) -> None:
            del self.ids[len(self.ids) + tokens_to_remove:]

    def __init__(self, vocab: int, n: int = 4):
        super().__init__()
        self.vocab, self.n = vocab, n

    def forward(self, input_ids: torch.Tensor, past_key_values: Context | None = None, use_cache: bool = True,
                logits_to_keep: int = 0):
        from types import SimpleNamespace

        context = past_key_values or self.Context([])
        context.ids.extend(input_ids[0].tolist())  # extended in place, as transformers' caches are
        row = context.ids
        logits = torch.zeros(1, len(row), self.vocab)
        last_seen: dict[tuple[int, ...], int] = {}
        for t in range(len(row)):
            gram = tuple(row[max(0, t - self.n + 1): t + 1])
            if gram in last_seen and last_seen[gram] + 1 < len(row):
                logits[0, t, row[last_seen[gram] + 1]] = 20.0
            last_seen[gram] = t
        kept = logits_to_keep or input_ids.shape[1]
        return SimpleNamespace(logits=logits[:, -kept:], past_key_values=context)


def test_passkey_scores_a_model_that_retrieves_1_and_an_untrained_one_about_chance(tmp_path: Path):
    """Passkey measured on two models whose answers are known: one that copies from its context finds every key at
    every depth; an untrained model ranks the true key first about one time in five (chance, 5 candidates); a model
    that cannot tell the keys apart (equal scores) gets none."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from compass.tasks.evaluation.retrieval import CANDIDATES, passkey_cells
    from tests.hub_cache import tiny_llama

    folder = tiny_llama(tmp_path / "untrained")
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    text = " ".join(p.read_text() for p in sorted((REPO / "tests" / "fixtures" / "corpus").rglob("*.txt")))
    haystack = np.asarray(tokenizer.encode(text, add_special_tokens=False))
    depths = [0.0, 0.5, 0.9]

    copier = passkey_cells(InContextCopier(len(tokenizer)), tokenizer, haystack, [256], depths, samples=10)
    assert [c["accuracy"] for c in copier] == [1.0, 1.0, 1.0]
    untrained = AutoModelForCausalLM.from_pretrained(str(folder)).eval()
    cells = passkey_cells(untrained, tokenizer, haystack, [256], depths, samples=40)
    accuracy = sum(c["accuracy"] for c in cells) / len(cells)
    assert abs(accuracy - 1 / CANDIDATES) < 0.12, accuracy  # 120 samples: chance within ~3 standard errors
    blind = InContextCopier(len(tokenizer), n=10**6)  # never matches: every candidate scores the same
    assert [c["accuracy"] for c in passkey_cells(blind, tokenizer, haystack, [256], depths, samples=5)] == [0.0] * 3
