"""Curation with datatrove: filters -> language id -> exact dedup -> MinHash dedup -> train/held-out shards.

Each stage is a datatrove pipeline run by its LocalPipelineExecutor with the data phase's CPUs (in this process,
or inside the step's Slurm job), or by its RayPipelineExecutor when the step is placed on Ray tasks; compass only
wires the blocks the spec names and collects stats.
"""

from __future__ import annotations

import inspect
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from compass.infra.die_with_parent import children_die_with_this_thread
from compass.infra.layout import DOCUMENTS, HELDOUT, SPLITS, TRAIN, CuratedArtifact
from compass.specs.base import Issue
from compass.specs.data import Curation
from compass.specs.spec import TrainingSpec
from compass.tasks.steps.context import Runtime, StepContext, StepResult
from compass.tasks.steps.kind import PlanBuilder, StepConfig, StepKind
from compass.tasks.steps.placement import phase


class CurateConfig(StepConfig):
    curation: Curation
    language: str | None
    domain: str


def build(plan: PlanBuilder) -> None:
    for src in plan.spec.what.data.sources:
        plan.add(KIND, src.name, CurateConfig(curation=src.curation, language=src.language, domain=src.domain),
                 {"raw": f"ingest:{src.name}"})


def check_machine(spec: TrainingSpec, _: Path) -> Iterator[Issue]:
    """Every filter parameter must be one the installed datatrove filter's constructor takes."""
    from compass.tasks.data.curate_blocks import FILTERS

    for i, src in enumerate(spec.what.data.sources):
        for j, flt in enumerate(src.curation.filters):
            cls = FILTERS[flt.name]
            accepted = [p for p in inspect.signature(cls.__init__).parameters if p not in ("self", "exclusion_writer")]
            for key in flt.params:
                if key not in accepted:
                    yield Issue(("what", "data", "sources", i, "curation", "filters", j, "params", key),
                                f"{cls.__name__} has no parameter '{key}'", f"accepted: {', '.join(accepted)}")


def run_curate(ctx: StepContext[CurateConfig]) -> StepResult:
    from datatrove.pipeline.dedup import (
        ExactDedupConfig,
        ExactDedupFilter,
        ExactDedupSignature,
        ExactFindDedups,
        MinhashConfig,
        MinhashDedupBuckets,
        MinhashDedupCluster,
        MinhashDedupFilter,
        MinhashDedupSignature,
    )
    from datatrove.pipeline.readers import JsonlReader
    from datatrove.pipeline.writers import JsonlWriter

    from compass.tasks.data.curate_blocks import (
        FILTERS,
        LanguageIdFilter,
        Measure,
        SplitTagger,
        document_text,
        portable_record,
    )

    cfg = ctx.config
    cur = cfg.curation
    raw = ctx.inputs["raw"].folder_url(DOCUMENTS)  # read in place by datatrove (s3:// or a local folder)
    work = ctx.scratch
    logs = ctx.out / "datatrove-logs"
    stages: list[dict[str, Any]] = []
    unmeasured = [Measure()]  # the first pass over the raw documents counts them, once

    def read(folder: Path | str) -> list:
        if folder == raw and unmeasured:
            return [JsonlReader(str(folder)), unmeasured.pop()]
        return [JsonlReader(str(folder))]

    n_shards = max(1, len(ctx.inputs["raw"].files(DOCUMENTS, ".jsonl.gz")))

    blocks = [FILTERS[f.name](**f.params) for f in cur.filters]
    if cur.language_id is not None:
        lid = cur.language_id
        blocks.append(LanguageIdFilter(lid.keep, lid.min_score, cfg.language))
    current: Path | str = raw
    if blocks:
        current = work / "filtered"
        stages.append(_run(ctx.runtime, "filter", logs,
                           [*read(raw), *blocks, JsonlWriter(str(current))], n_shards))
        if not any(current.glob("*.jsonl.gz")):
            raise ValueError(f"curation of {ctx.name} removed every document ({_removal_reasons(stages)}); "
                             "loosen its filters")

    if cur.exact_dedup:
        exact = ExactDedupConfig(content_getter=document_text)
        stages.append(_run(ctx.runtime, "exact-signature", logs,
                           [*read(current), ExactDedupSignature(str(work / "exact-sigs"), exact)],
                           n_shards))
        stages.append(_run(ctx.runtime, "exact-find", logs,
                           [ExactFindDedups(str(work / "exact-sigs"), str(work / "exact-dups"), exact)], 1))
        stages.append(_run(ctx.runtime, "exact-filter", logs,
                           [*read(current), ExactDedupFilter(str(work / "exact-dups"), exact),
                            JsonlWriter(str(work / "exact"))], n_shards))
        current = work / "exact"

    if cur.minhash:
        mh = cur.minhash
        config = MinhashConfig(n_grams=mh.n_grams, num_buckets=mh.num_buckets, hashes_per_bucket=mh.hashes_per_bucket)
        stages.append(_run(ctx.runtime, "minhash-signature", logs,
                           [*read(current), MinhashDedupSignature(str(work / "mh-sigs"), config)],
                           n_shards))
        stages.append(_run(ctx.runtime, "minhash-buckets", logs,
                           [MinhashDedupBuckets(str(work / "mh-sigs"), str(work / "mh-buckets"), config=config)],
                           config.num_buckets))
        stages.append(_run(ctx.runtime, "minhash-cluster", logs,
                           [MinhashDedupCluster(str(work / "mh-buckets"), str(work / "mh-remove"), config=config)], 1))
        stages.append(_run(ctx.runtime, "minhash-filter", logs,
                           [*read(current), MinhashDedupFilter(str(work / "mh-remove")),
                            JsonlWriter(str(work / "minhash"))], n_shards))
        current = work / "minhash"

    stages.append(_run(ctx.runtime, "split", logs,
                       [*read(current), SplitTagger(cur.heldout_fraction),
                        JsonlWriter(str(ctx.out), output_filename="${split}/${rank}.jsonl.gz",
                                    adapter=portable_record)], n_shards))

    curated = CuratedArtifact(ctx.out)
    before = _counted(stages, Measure)
    after = {split: _counted(stages[-1:], SplitTagger, f"{split}_") for split in SPLITS}
    kept = {k: after[TRAIN][k] + after[HELDOUT][k] for k in before}
    reasons = _removal_reasons(stages)
    stats = {"before": before, "after": kept, "splits": after, "removed_by": reasons, "stages": stages,
             "dropped_at_ingest": ctx.inputs["raw"].manifest.metrics.get("dropped", {})}
    curated.stats.write_text(json.dumps(stats, indent=2))
    if kept["documents"] == 0:
        raise ValueError(f"curation of {ctx.name} removed every document ({reasons}); loosen its filters")
    metrics = {
        "documents_in": before["documents"], "documents_out": kept["documents"],
        "words_in": before["words"], "words_out": kept["words"],
        "bytes_in": before["bytes"], "bytes_out": kept["bytes"],
        "train_documents": after[TRAIN]["documents"], "heldout_documents": after[HELDOUT]["documents"],
        "removed_by": reasons,
    }
    rows = [{"measure": m, "in": before[m], "out": kept[m], "kept %": round(100 * kept[m] / max(1, before[m]), 1)}
            for m in ("documents", "words", "bytes")]
    rows += [{"measure": f"removed by {r}", "in": "", "out": n, "kept %": ""} for r, n in reasons.items()]
    summary = (f"### curate `{ctx.name}`\n\n{before['documents']:,} -> {kept['documents']:,} documents "
               f"({after['train']['documents']:,} train, {after['heldout']['documents']:,} held out); "
               f"removed by: {reasons or 'nothing'}")
    return StepResult(metrics=metrics, summary=summary, tables={"curation": rows})


def _run(runtime: Runtime, stage: str, logs: Path, pipeline: list, tasks: int) -> dict[str, Any]:
    """Run one datatrove pipeline with the executor the step's placement says (datatrove's Ray executor for
    ray_tasks, else its local one with the phase's CPUs) and return its merged block statistics."""
    logging_dir = logs / stage
    orch = runtime.how.orchestration
    placement = runtime.placement
    if placement.mode == "ray_tasks":
        from datatrove.executor import RayPipelineExecutor

        executor = RayPipelineExecutor(pipeline, tasks=tasks, workers=orch.workers,
                                       logging_dir=str(logging_dir), skip_completed=False)
    else:
        import multiprocess
        from datatrove.executor import LocalPipelineExecutor

        multiprocess.set_forkserver_preload(["compass.infra.forkserver_preload"])  # its workers die with this run
        workers = placement.shape.cpus_per_node if placement.shape and placement.shape.cpus_per_node else orch.workers
        executor = LocalPipelineExecutor(pipeline, tasks=tasks, workers=min(tasks, workers),
                                         logging_dir=str(logging_dir), skip_completed=False)
    with children_die_with_this_thread():  # datatrove's Manager process too
        executor.run()
    missing = executor.get_incomplete_ranks(range(tasks), skip_completed=True)
    if missing:  # Ray's executor logs a lost task group and returns: an incomplete stage must not be committed
        raise RuntimeError(f"datatrove stage {stage} finished without ranks {missing} of {tasks}; "
                           f"see {logging_dir / 'logs'}")
    blocks = _merged_block_stats(logging_dir, tasks)
    return {"stage": stage, "blocks": [{"name": b.get("name"), "stats": _plain_stats(b.get("stats", {}))}
                                       for b in blocks]}


def _merged_block_stats(logging_dir: Path, tasks: int) -> list[dict[str, Any]]:
    """The stage's statistics, merged from every rank's file: Ray's executor skips the merged stats.json when it
    counted a resubmitted task as failed, though every rank completed."""
    from datatrove.utils.stats import PipelineStats

    merged = logging_dir / "stats.json"
    if merged.exists():
        return json.loads(merged.read_text())
    total = PipelineStats()
    for rank in range(tasks):
        total += PipelineStats.from_json(json.loads((logging_dir / "stats" / f"{rank:05d}.json").read_text()))
    return json.loads(total.to_json())


def _plain_stats(stats: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for key, value in stats.items():
        out[key] = value.get("total", value) if isinstance(value, dict) else value
    return out


def _removal_reasons(stages: list[dict[str, Any]]) -> dict[str, int]:
    """Documents each block removed: `dropped_<reason>` counts where a filter gives reasons, else `dropped`."""
    reasons: dict[str, int] = {}
    for stage in stages:
        for block in stage["blocks"]:
            stats = block["stats"]
            detailed = {k.removeprefix("dropped_"): v for k, v in stats.items() if k.startswith("dropped_")}
            name = _block_label(str(block["name"]))
            if detailed:
                for reason, n in detailed.items():
                    reasons[f"{name}: {reason}"] = int(n)
            elif stats.get("dropped"):
                reasons[name] = int(stats["dropped"])
    return {k: v for k, v in reasons.items() if v}


def _block_label(name: str) -> str:
    """'🔻 - FILTER: 👯 Gopher Repetition' -> 'gopher_repetition'; dedup filters -> exact_dedup/minhash_dedup."""
    if "DEDUP" in name.upper():
        return "minhash_dedup" if "minhash" in name.lower() else "exact_dedup"
    words = re.findall(r"[A-Za-z0-9]+", name.rsplit(":", 1)[-1])
    return "_".join(words).lower() or name


def _counted(stages: list[dict[str, Any]], block: type, prefix: str = "") -> dict[str, int]:
    """Documents, words and bytes the first `block` of `stages` counted (datatrove's merged statistics, named as
    datatrove names a block: `<type>: <name>`)."""
    name = f"{block.type}: {block.name}"
    stats = next((b["stats"] for stage in stages for b in stage["blocks"] if b["name"] == name), {})
    return {m: int(stats.get(f"{prefix}{m}", 0)) for m in ("documents", "words", "bytes")}


KIND = StepKind("curate", CurateConfig, run_curate, build, version="3", resources=phase("data"), tags=("data",),
                check_machine=check_machine)
STEP_KINDS = (KIND,)
