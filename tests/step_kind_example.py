"""A step kind defined entirely in one module, the way a team adds its own: a config model, its typed inputs, a
builder that adds its steps to the plan (after the kinds whose steps it reads), an executor, the resources its steps
need, and the StepKind record. tests/test_architecture.py registers it and runs it through compile, plan and run;
tests/test_placement.py places it."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, replace

from compass.infra.layout import SHARD_SUFFIX, TRAIN, CuratedArtifact
from compass.specs.how import How, Shape
from compass.tasks.data.shard_codec import open_shard
from compass.tasks.steps.context import StepContext, StepResult
from compass.tasks.steps.kind import PlanBuilder, StepKind
from compass.tasks.steps.step_config import StepConfig
from compass.tasks.steps.wiring import Inputs, StepRef


class WordCountConfig(StepConfig):
    """Count words of at least `min_length` letters in one curated source's training split."""

    min_length: int


@dataclass(frozen=True)
class WordCountInputs(Inputs):
    curated: StepRef  # one curated source


def build(plan: PlanBuilder) -> None:
    for curate in plan.of_kind("curate"):
        plan.add(KIND, curate.name, WordCountConfig(min_length=4), WordCountInputs(curated=curate.ref))


def run(ctx: StepContext[WordCountConfig]) -> StepResult:
    pattern = re.compile(rf"\b\w{{{ctx.config.min_length},}}\b")
    words = documents = 0
    curated = ctx.given(WordCountInputs).curated
    for shard in sorted(CuratedArtifact(curated.local()).split(TRAIN).glob("*" + SHARD_SUFFIX)):
        with open(shard, "rb") as raw, open_shard(raw) as f:
            for line in f:
                words += len(pattern.findall(json.loads(line)["text"]))
                documents += 1
    (ctx.out / "counts.json").write_text(json.dumps({"words": words, "documents": documents}))
    return StepResult(metrics={"words": words, "documents": documents},
                      summary=f"### word count `{ctx.name}`\n\n{words:,} words in {documents:,} documents")


def resources(config: WordCountConfig, how: How) -> Shape:
    """Where a count runs: like the data steps, on one CPU (it reads one file at a time)."""
    return replace(how.shape("data"), cpus_per_node=1)


KIND = StepKind("word_count", WordCountConfig, run, build, version="1", resources=resources, inputs=WordCountInputs,
                after=("curate",))
STEP_KINDS = (KIND,)
