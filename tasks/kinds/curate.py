"""Curation with datatrove: filters -> language id -> exact dedup -> MinHash dedup -> train/held-out shards.

Each stage is a datatrove pipeline run by the executor the step's placement names (tasks/data/datatrove_stages.py):
its LocalPipelineExecutor with the data phase's CPUs, its RayPipelineExecutor on Ray tasks, or job arrays of its
SlurmPipelineExecutor under a cluster. compass only wires the blocks the spec names and collects stats. Every
stage writes into the step's work folder, so a relaunch after a failure redoes only the ranks that did not
complete; the split's shards are then linked into the artifact.
"""

from __future__ import annotations

import inspect
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from compass.infra.errors import DataError
from compass.infra.layout import DOCUMENTS, HELDOUT, SHARD_SUFFIX, SPLITS, TRAIN, CuratedArtifact
from compass.specs.base import Issue
from compass.specs.data import Curation, DataSource, HeldoutUnit
from compass.specs.how import CONTENT_BYTE_COST
from compass.specs.spec import TrainingSpec
from compass.tasks.data.datatrove_stages import StageStats, rank_block_stats, run_stage
from compass.tasks.data.places import DataPlaces
from compass.tasks.steps.context import InputArtifact, StepContext, StepResult
from compass.tasks.steps.kind import PlanBuilder, StepKind
from compass.tasks.steps.placement import phase
from compass.tasks.steps.step_config import StepConfig
from compass.tasks.steps.wiring import Inputs, R


class CurateConfig(StepConfig):
    curation: Curation
    language: str | None
    domain: str
    # what falls on one side of the held-out split whole; None: the document (the identity of such steps is as it was)
    heldout_unit: HeldoutUnit | None = None

    omit_when_none: ClassVar[frozenset[str]] = frozenset({"heldout_unit"})


def heldout_unit(source: DataSource) -> HeldoutUnit | None:
    """A web archive's page, a sectioned file (a page, a play, a source file cut into sections), else the document
    itself (a record of a JSONL or Parquet file, a whole file): sections of one page on both sides of the split would
    let perplexity be measured on text whose neighbours were trained on."""
    if source.format == "warc":
        return "page"
    return "file" if source.split == "sections" else None


@dataclass(frozen=True)
class CurateInputs(Inputs[R]):
    raw: R  # the source's ingested documents


def build(plan: PlanBuilder) -> None:
    for src in plan.spec.what.data.sources:
        plan.add(KIND, src.name, CurateConfig(curation=src.curation, language=src.language, domain=src.domain,
                                              heldout_unit=heldout_unit(src)),
                 CurateInputs(raw=plan.ref("ingest", src.name)))


def check_spec(spec: TrainingSpec, _: Path) -> Iterator[Issue]:
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

    from compass.tasks.data.curate_blocks import (
        FILTERS,
        LanguageIdFilter,
        Measure,
        ShardWriter,
        SplitTagger,
        document_text,
        portable_record,
    )

    cfg = ctx.config
    cur = cfg.curation
    ingested = ctx.given(CurateInputs).raw
    raw = ingested.folder_url(DOCUMENTS)  # read in place by datatrove (s3:// or a local folder)
    places = DataPlaces.of(ctx)  # kept across attempts: completed ranks are not redone
    logs = places.stage_logs
    stages: list[StageStats] = []
    unmeasured = [Measure()]  # the first pass over the raw documents counts them, once

    def read(folder: str) -> list:
        if folder == raw and unmeasured:
            return [JsonlReader(folder), unmeasured.pop()]
        return [JsonlReader(folder)]

    raw_shards = ingested.files(DOCUMENTS, SHARD_SUFFIX)
    raw_bytes = sum(e.size for e in raw_shards)  # every stage reads at most this much (filtered copies of it)

    def run(stage: str, pipeline: list, tasks: int, cost_per_byte: float = 1.0) -> StageStats:
        return run_stage(ctx.runtime, stage, logs, pipeline, tasks, ctx.log, raw_bytes, cost_per_byte)

    n_shards = max(1, len(raw_shards))

    blocks = [FILTERS[f.name](**f.params) for f in cur.filters]
    if cur.language_id is not None:
        lid = cur.language_id
        blocks.append(LanguageIdFilter(lid.keep, lid.min_score, cfg.language))
    # The content filters (the costly blocks) are written out once where a dedup stage must read what they kept;
    # each dedup's removal (a lookup of the indices it found) then rides along in every later pass over that
    # folder, and the last blocks run in the split's own pass: no intermediate copy of the corpus is written for a
    # dedup, and none for the filters alone.
    current, pending = raw, blocks
    removals: list = []  # fresh dedup filters for each pass, in order

    def filtered() -> list:
        return [make() for make in removals]

    if (cur.exact_dedup or cur.minhash) and pending:
        folder = places.intermediate("filtered")
        stages.append(run("filter", [*read(current), *pending, ShardWriter(folder)], n_shards, CONTENT_BYTE_COST))
        if not _written(stages[-1]):
            raise DataError(f"curation of {ctx.name} removed every document ({_removal_reasons(stages)}); "
                             "loosen its filters")
        current, pending = folder, []

    if cur.exact_dedup:
        exact = ExactDedupConfig(content_getter=document_text)
        sigs, dups = places.intermediate("exact-sigs"), places.intermediate("exact-dups")
        stages.append(run("exact-signature", [*read(current), ExactDedupSignature(sigs, exact)], n_shards))
        stages.append(run("exact-find", [ExactFindDedups(sigs, dups, exact)], 1))
        removals.append(lambda: ExactDedupFilter(dups, exact))

    if cur.minhash:
        mh = cur.minhash
        config = MinhashConfig(n_grams=mh.n_grams, num_buckets=mh.num_buckets, hashes_per_bucket=mh.hashes_per_bucket)
        sigs, buckets = places.intermediate("mh-sigs"), places.intermediate("mh-buckets")
        remove = places.intermediate("mh-remove")
        # the signatures index the documents the exact removal kept, as the MinHash filter below sees them
        stages.append(run("minhash-signature", [*read(current), *filtered(), MinhashDedupSignature(sigs, config)],
                          n_shards, CONTENT_BYTE_COST))
        stages.append(run("minhash-buckets", [MinhashDedupBuckets(sigs, buckets, config=config)],
                          config.num_buckets))
        stages.append(run("minhash-cluster", [MinhashDedupCluster(buckets, remove, config=config)], 1))
        removals.append(lambda: MinhashDedupFilter(remove))

    stages.append(run("split",
                       [*read(current), *pending, *filtered(),
                        SplitTagger(cur.heldout_fraction, ctx.config.heldout_unit or "document"),
                        ShardWriter(places.output("split"), output_filename="${split}/${rank}" + SHARD_SUFFIX,
                                    adapter=portable_record, written_records=places.records("split"))], n_shards,
                       CONTENT_BYTE_COST if pending else 1.0))
    if not _written(stages[-1]):
        raise DataError(f"curation of {ctx.name} removed every document ({_removal_reasons(stages)}); "
                         "loosen its filters")
    places.publish(ctx, ["split"], "split")
    return _curation_result(ctx, ingested, logs, stages, n_shards)


def _curation_result(ctx: StepContext[CurateConfig], ingested: InputArtifact, logs: Path, stages: list[StageStats],
                     n_shards: int) -> StepResult:
    """What the passes kept and removed, from their datatrove stats: the artifact's stats.json, the step's metrics,
    its summary and table. Fails the step when nothing is left."""
    from compass.tasks.data.curate_blocks import Measure, SplitTagger

    curated = CuratedArtifact(ctx.out)
    before = _counted(stages, Measure)
    after = {split: _counted(stages[-1:], SplitTagger, f"{split}_") for split in SPLITS}
    kept = {k: after[TRAIN][k] + after[HELDOUT][k] for k in before}
    reasons = _removal_reasons(stages)
    tagged = rank_block_stats(logs, "split", n_shards, f"{SplitTagger.type}: {SplitTagger.name}")
    per_shard = {f"{split}/{rank:05d}{SHARD_SUFFIX}": int(r[f"{split}_documents"])
                 for split in SPLITS for rank, r in enumerate(tagged) if r.get(f"{split}_documents")}
    stats = {"before": before, "after": kept, "splits": after, "per_shard": per_shard, "removed_by": reasons,
             "stages": [s.model_dump() for s in stages],
             "dropped_at_ingest": ingested.manifest.metrics.get("dropped", {})}
    curated.stats.write_text(json.dumps(stats, indent=2))
    if kept["documents"] == 0:
        raise DataError(f"curation of {ctx.name} removed every document ({reasons}); loosen its filters")
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


def _removal_reasons(stages: list[StageStats]) -> dict[str, int]:
    """Documents each block removed: `dropped_<reason>` counts where a filter gives reasons, else `dropped`."""
    reasons: dict[str, int] = {}
    for stage in stages:
        for block in stage.blocks:
            stats = block.stats
            detailed = {k.removeprefix("dropped_"): v for k, v in stats.items() if k.startswith("dropped_")}
            name = _block_label(block.name)
            if detailed:
                for reason, n in detailed.items():
                    reasons[f"{name}: {reason}"] = int(n)
            elif stats.get("dropped"):
                reasons[name] = int(stats["dropped"])
    return {k: v for k, v in reasons.items() if v}


def _written(stage: StageStats) -> int:
    """Documents the stage's shard writer wrote (datatrove counts each as its writer's `total`)."""
    from compass.tasks.data.curate_blocks import ShardWriter

    name = f"{ShardWriter.type}: {ShardWriter.name}"
    return sum(int(b.stats.get("total", 0)) for b in stage.blocks if b.name == name)


def _block_label(name: str) -> str:
    """'🔻 - FILTER: 👯 Gopher Repetition' -> 'gopher_repetition'; dedup filters -> exact_dedup/minhash_dedup."""
    if "DEDUP" in name.upper():
        return "minhash_dedup" if "minhash" in name.lower() else "exact_dedup"
    words = re.findall(r"[A-Za-z0-9]+", name.rsplit(":", 1)[-1])
    return "_".join(words).lower() or name


def _counted(stages: list[StageStats], block: type, prefix: str = "") -> dict[str, int]:
    """Documents, words and bytes the first `block` of `stages` counted (datatrove's merged statistics, named as
    datatrove names a block: `<type>: <name>`)."""
    name = f"{block.type}: {block.name}"
    stats = next((b.stats for stage in stages for b in stage.blocks if b.name == name), {})
    return {m: int(stats.get(f"{prefix}{m}", 0)) for m in ("documents", "words", "bytes")}


# 5: shards in zstd (level 3), not gzip -6; 6: the dedup removals and the filters without a dedup run in later
# passes, not written out (a rank whose intermediate was empty no longer shifts the later ranks' files)
KIND = StepKind("curate", CurateConfig, run_curate, build, version="6", resources=phase("data"),
                check_spec=check_spec, fans_out=True, inputs=CurateInputs, after=("ingest",),
                headline=("documents_in", "documents_out"))
STEP_KINDS = (KIND,)
