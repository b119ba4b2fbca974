"""Tokenize one curated source with the chosen tokenizer into a shard set of memory-mappable arrays
(model/training/token_files.py): per split, a datatrove pipeline (its JsonlReader streaming the curated shards from
the store, then TokenShards) of one task per curated shard, run by the executor the step's placement names, as
curation's stages are (tasks/data/datatrove_stages.py: Slurm job arrays under a cluster). Each task writes one
token shard, streamed, so a task's memory is one batch of documents and one block of tokens whatever the size.

Tokenize steps are added on demand: a kind that trains or measures on a source asks for its tokens with
`plan.require("tokenize", source)`, so a source nobody trains on is never tokenized.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from compass.infra.layout import SHARD_SUFFIX, SPLITS, TRAIN, TokenizerArtifact
from compass.tasks.common.fence import INDEX_FOLDER, fence_read_by, trained_sources
from compass.tasks.data.datatrove_stages import rank_block_stats, run_stage
from compass.tasks.data.places import DataPlaces
from compass.tasks.data.tokenizer_files import eos_id
from compass.tasks.steps.context import InputArtifact, StepContext, StepResult
from compass.tasks.steps.kind import PlanBuilder, StepKind
from compass.tasks.steps.placement import phase
from compass.tasks.steps.step_config import EmptyConfig
from compass.tasks.steps.wiring import Inputs, R


@dataclass(frozen=True)
class TokenizeInputs(Inputs[R]):
    tokenizer: R
    curated: R
    fence: R | None = None  # the decontamination fence whose matches the train split leaves out (`remove`)


def provide(plan: PlanBuilder, source: str) -> None:
    """The step that tokenizes `source`, added the first time a kind asks for it (PlanBuilder.require)."""
    fence = fence_read_by(plan) if source in trained_sources(plan.spec) else None
    inputs = TokenizeInputs(tokenizer=plan.tokenizer(), curated=plan.ref("curate", source), fence=fence)
    plan.add(KIND, source, EmptyConfig(), inputs)


def tokenize_curated(tokenizer: Path, curated: InputArtifact, ctx: StepContext,
                     fenced: InputArtifact | None = None) -> dict[str, Any]:
    """Every split of a curated source into token shards of the step's artifact, one datatrove task per curated
    shard; no copy of the source is made. The step's work folder keeps the stages' completion markers (and, with a
    local store, the shards) across attempts. `fenced`: the decontamination fence whose matches the train split
    leaves out (recorded per benchmark as `decontaminated`). Returns documents and tokens per split."""
    from datatrove.pipeline.readers import JsonlReader
    from tokenizers import Tokenizer

    from compass.model.training.token_files import token_dtype, write_counts, write_meta
    from compass.tasks.data.fence_blocks import FenceFilter
    from compass.tasks.data.token_shards import TokenShards

    vocab = Tokenizer.from_file(str(tokenizer / "tokenizer.json")).get_vocab_size()
    eos = eos_id(tokenizer)
    dtype = token_dtype(vocab)
    places = DataPlaces.of(ctx)
    shard_folder = places.output("tokens")
    counts: dict[str, Any] = {}
    removed: dict[str, int] = {}
    for split in SPLITS:
        tasks = len(curated.files(split, SHARD_SUFFIX))
        ranks = []  # rank r wrote token shard r
        if tasks:
            reader = JsonlReader(curated.folder_url(split), glob_pattern="*" + SHARD_SUFFIX, doc_progress=False)
            writer = TokenShards(str(tokenizer / "tokenizer.json"), shard_folder, split, eos, dtype.name,
                                 written_records=places.records(f"tokenize-{split}"))
            fence = [FenceFilter(fenced.folder_url(INDEX_FOLDER))] if fenced is not None and split == TRAIN else []
            run_stage(ctx.runtime, f"tokenize-{split}", places.stage_logs, [reader, *fence, writer], tasks, ctx.log,
                      sum(e.size for e in curated.files(split, SHARD_SUFFIX)))
            if fence:
                dropped = rank_block_stats(places.stage_logs, f"tokenize-{split}", tasks,
                                           f"{FenceFilter.type}: {FenceFilter.name}")
                for rank in dropped:
                    for key, value in rank.items():
                        if key.startswith("dropped_contaminated_"):
                            benchmark = key.removeprefix("dropped_contaminated_")
                            removed[benchmark] = removed.get(benchmark, 0) + int(value)
            ranks = rank_block_stats(places.stage_logs, f"tokenize-{split}", tasks,
                                     f"{TokenShards.type}: {TokenShards.name}")
        documents, tokens = [int(r.get("documents", 0)) for r in ranks], [int(r.get("tokens", 0)) for r in ranks]
        write_counts(ctx.out, split, documents, tokens)
        counts[f"{split}_documents"], counts[f"{split}_tokens"] = sum(documents), sum(tokens)
    places.publish(ctx, [f"tokenize-{split}" for split in SPLITS], "tokens")
    write_meta(ctx.out, dtype, eos, vocab)
    if fenced is not None:
        counts["decontaminated"] = removed
    return counts


def run_tokenize(ctx: StepContext[EmptyConfig]) -> StepResult:
    given = ctx.given(TokenizeInputs)
    tokenizer = TokenizerArtifact(given.tokenizer.local()).chosen
    metrics = tokenize_curated(tokenizer, given.curated, ctx, given.fence)
    summary = (f"### tokenize `{ctx.name}`\n\n{metrics['train_tokens']:,} training tokens in "
               f"{metrics['train_documents']:,} documents; {metrics['heldout_tokens']:,} held-out tokens")
    return StepResult(metrics=metrics, summary=summary)


KIND = StepKind("tokenize", EmptyConfig, run_tokenize, None, version="3", resources=phase("data"),
                fans_out=True, inputs=TokenizeInputs, provide=provide,  # no transformers: tokenizers alone
                after=("curate", "tokenizer", "base_model"),
                headline=("train_tokens", "heldout_tokens"))
STEP_KINDS = (KIND,)
