"""Every item a benchmark of the spec scores, as question and gold answers: what the decontamination fence indexes
(tasks/data/decontamination.py). The items are read from the same data the evaluation reads: compass's offline
benchmarks from their prepared files, lighteval's tasks through lighteval's own task (its evaluation split, on the
local copy of its dataset). The whole split is indexed, whatever `limit` the evaluation uses."""

from __future__ import annotations

import json
from collections.abc import Iterator

from compass.specs.evaluation import Benchmark
from compass.tasks.data.decontamination import BenchmarkItem
from compass.tasks.evaluation.lighteval_benchmarks import local_configs, locate
from compass.tasks.evaluation.offline_benchmarks import prepare


def items_of(benchmark: Benchmark) -> Iterator[BenchmarkItem]:
    if benchmark.source == "lighteval":
        yield from _lighteval_items(benchmark)
        return

    folder, _ = prepare(benchmark.name)
    with (folder / "validation.jsonl").open(encoding="utf-8") as f:
        for line in f:
            row = json.loads(line)
            golds = tuple(row["answers"]) if "answers" in row else (row["choices"][row["gold"]],)
            yield BenchmarkItem(benchmark.key, row["question"], golds)


def _lighteval_items(benchmark: Benchmark) -> Iterator[BenchmarkItem]:
    from lighteval.tasks.lighteval_task import LightevalTask


    local = locate(benchmark.name, benchmark.fewshot)
    (config,) = local_configs({benchmark.name: str(local.dataset)})
    task = LightevalTask(config)
    LightevalTask.load_datasets({config.name: task})
    for doc in task.eval_docs():
        yield BenchmarkItem(benchmark.key, doc.query, tuple(str(g) for g in doc.get_golds()))
