"""A step kind defined entirely in one module, the way a team adds its own: a config model, a builder that adds
its steps to the plan, an executor, and the StepKind record. tests/test_architecture.py registers it and runs it
through compile, plan and run."""

from __future__ import annotations

import gzip
import json
import re

from compass.tasks.steps.context import StepContext, StepResult
from compass.tasks.steps.kind import PlanBuilder, StepConfig, StepKind


class WordCountConfig(StepConfig):
    """Count words of at least `min_length` letters in one curated source's training split."""

    min_length: int


def build(plan: PlanBuilder) -> None:
    for curate in plan.of_kind("curate"):
        plan.add(KIND, curate.name, WordCountConfig(min_length=4), {"curated": curate.id})


def run(ctx: StepContext[WordCountConfig]) -> StepResult:
    pattern = re.compile(rf"\b\w{{{ctx.config.min_length},}}\b")
    words = documents = 0
    for shard in sorted((ctx.inputs["curated"].local() / "train").glob("*.jsonl.gz")):
        with gzip.open(shard, "rt") as f:
            for line in f:
                words += len(pattern.findall(json.loads(line)["text"]))
                documents += 1
    (ctx.out / "counts.json").write_text(json.dumps({"words": words, "documents": documents}))
    return StepResult(metrics={"words": words, "documents": documents},
                      summary=f"### word count `{ctx.name}`\n\n{words:,} words in {documents:,} documents")


KIND = StepKind("word_count", WordCountConfig, run, build, version="1", tags=("data",))
STEP_KINDS = (KIND,)
