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

from compass.infra.layout import SPLITS, TokenizerArtifact
from compass.tasks.data.datatrove_stages import rank_block_stats, run_stage
from compass.tasks.data.places import DataPlaces
from compass.tasks.data.tokenizer_files import tokenizer_ids
from compass.tasks.steps.context import InputArtifact, StepContext, StepResult
from compass.tasks.steps.kind import TRANSFORMERS, EmptyConfig, PlanBuilder, StepKind
from compass.tasks.steps.placement import phase
from compass.tasks.steps.wiring import Inputs, StepRef


@dataclass(frozen=True)
class TokenizeInputs(Inputs):
    tokenizer: StepRef
    curated: StepRef


def provide(plan: PlanBuilder, source: str) -> None:
    """The step that tokenizes `source`, added the first time a kind asks for it (PlanBuilder.require)."""
    inputs = TokenizeInputs(tokenizer=plan.tokenizer(), curated=plan.ref("curate", source))
    plan.add(KIND, source, EmptyConfig(), inputs)


def tokenize_curated(tokenizer: Path, curated: InputArtifact, ctx: StepContext) -> dict[str, int]:
    """Every split of a curated source into token shards of the step's artifact, one datatrove task per curated
    shard; no copy of the source is made. The step's work folder keeps the stages' completion markers (and, with a
    local store, the shards) across attempts. Returns documents and tokens per split."""
    from datatrove.pipeline.readers import JsonlReader
    from tokenizers import Tokenizer

    from compass.model.training.token_files import token_dtype, write_counts, write_meta
    from compass.tasks.data.token_shards import TokenShards

    vocab = Tokenizer.from_file(str(tokenizer / "tokenizer.json")).get_vocab_size()
    eos = tokenizer_ids(tokenizer).eos
    dtype = token_dtype(vocab)
    places = DataPlaces.of(ctx)
    shard_folder = places.output("tokens")
    counts: dict[str, int] = {}
    for split in SPLITS:
        tasks = len(curated.files(split, ".jsonl.gz"))
        ranks = []  # rank r wrote token shard r
        if tasks:
            reader = JsonlReader(curated.folder_url(split), glob_pattern="*.jsonl.gz", doc_progress=False)
            writer = TokenShards(str(tokenizer / "tokenizer.json"), shard_folder, split, eos, dtype.name,
                                 written_records=places.records(f"tokenize-{split}"))
            run_stage(ctx.runtime, f"tokenize-{split}", places.stage_logs, [reader, writer], tasks, ctx.log,
                      sum(e.size for e in curated.files(split, ".jsonl.gz")))
            ranks = rank_block_stats(places.stage_logs, f"tokenize-{split}", tasks,
                                     f"{TokenShards.type}: {TokenShards.name}")
        documents, tokens = [int(r.get("documents", 0)) for r in ranks], [int(r.get("tokens", 0)) for r in ranks]
        write_counts(ctx.out, split, documents, tokens)
        counts[f"{split}_documents"], counts[f"{split}_tokens"] = sum(documents), sum(tokens)
    places.publish(ctx, [f"tokenize-{split}" for split in SPLITS], "tokens")
    write_meta(ctx.out, dtype, eos, vocab)
    return counts


def run_tokenize(ctx: StepContext[EmptyConfig]) -> StepResult:
    tokenizer = TokenizerArtifact(ctx.inputs["tokenizer"].local()).chosen
    metrics = tokenize_curated(tokenizer, ctx.inputs["curated"], ctx)
    summary = (f"### tokenize `{ctx.name}`\n\n{metrics['train_tokens']:,} training tokens in "
               f"{metrics['train_documents']:,} documents; {metrics['heldout_tokens']:,} held-out tokens")
    return StepResult(metrics=metrics, summary=summary)


KIND = StepKind("tokenize", EmptyConfig, run_tokenize, None, version="3", resources=phase("data"),
                imports=TRANSFORMERS, fans_out=True, inputs=TokenizeInputs, provide=provide,
                after=("curate", "tokenizer", "base_model"),
                headline=("train_tokens", "heldout_tokens"))
STEP_KINDS = (KIND,)
