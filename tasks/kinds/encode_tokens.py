"""Tokenize one curated source with the chosen tokenizer into memory-mappable arrays (model/token_files.py).

Tokenize steps are added on demand: a kind that trains or measures on a source asks for its tokens with
`tokens_of`, so a source nobody trains on is never tokenized.
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Iterator
from pathlib import Path

from compass.infra.layout import SPLITS, TokenizerArtifact
from compass.tasks.data.tokenizer_files import tokenizer_ids
from compass.tasks.kinds.select_tokenizer import tokenizer_step
from compass.tasks.steps.context import InputArtifact, StepContext, StepResult
from compass.tasks.steps.kind import TRANSFORMERS, EmptyConfig, PlanBuilder, StepKind
from compass.tasks.steps.placement import phase

BATCH = 256
BATCH_CHARS = 1 << 23  # 8M characters


def tokens_of(plan: PlanBuilder, source: str) -> str:
    """The id of the step that tokenizes `source`, added the first time it is asked for."""
    step_id = f"tokenize:{source}"
    if not plan.has(step_id):
        plan.add(KIND, source, EmptyConfig(), {"tokenizer": tokenizer_step(plan), "curated": f"curate:{source}"})
    return step_id


def data_inputs(plan: PlanBuilder, sources: list[str]) -> dict[str, str]:
    """Inputs of a step that trains on `sources`: the tokenizer, and each source's tokens as `tokens:<name>`."""
    return {"tokenizer": tokenizer_step(plan), **{f"tokens:{n}": tokens_of(plan, n) for n in sorted(sources)}}


def _texts(curated: InputArtifact, split: str) -> Iterator[str]:
    """The split's documents, each shard streamed from the store in turn (checked as it is read)."""
    for entry in curated.files(split, ".jsonl.gz"):
        with curated.open(entry) as raw, gzip.open(raw, "rt", encoding="utf-8") as f:
            for line in f:
                yield json.loads(line)["text"]


def _batches(texts: Iterator[str]) -> Iterator[list[str]]:
    """Texts in batches of at most BATCH documents and about BATCH_CHARS characters: what is held at once."""
    batch: list[str] = []
    chars = 0
    for text in texts:
        batch.append(text)
        chars += len(text)
        if len(batch) == BATCH or chars >= BATCH_CHARS:
            yield batch
            batch, chars = [], 0
    if batch:
        yield batch


def _ids(tok, texts: Iterator[str]) -> Iterator[list[int]]:
    for batch in _batches(texts):  # encoded in parallel by the tokenizer's threads, without character offsets
        yield from (enc.ids for enc in tok.encode_batch_fast(batch))


def tokenize_curated(tokenizer: Path, curated: InputArtifact, out: Path) -> dict[str, int]:
    """Every split of a curated source into token files in `out`, streamed: memory is one batch of documents and
    one block of tokens whatever the source's size, and no copy of the source is made. Returns documents and
    tokens per split."""
    from tokenizers import Tokenizer

    from compass.model.training.token_files import token_dtype, write_meta, write_split

    tok = Tokenizer.from_file(str(tokenizer / "tokenizer.json"))
    eos = tokenizer_ids(tokenizer).eos
    dtype = token_dtype(tok.get_vocab_size())
    counts: dict[str, int] = {}
    for split in SPLITS:
        documents, tokens = write_split(out, split, _ids(tok, _texts(curated, split)), eos, dtype)
        counts[f"{split}_documents"] = documents
        counts[f"{split}_tokens"] = tokens
    write_meta(out, dtype, eos, tok.get_vocab_size())
    return counts


def run_tokenize(ctx: StepContext[EmptyConfig]) -> StepResult:
    tokenizer = TokenizerArtifact(ctx.inputs["tokenizer"].local()).chosen
    metrics = tokenize_curated(tokenizer, ctx.inputs["curated"], ctx.out)
    summary = (f"### tokenize `{ctx.name}`\n\n{metrics['train_tokens']:,} training tokens in "
               f"{metrics['train_documents']:,} documents; {metrics['heldout_tokens']:,} held-out tokens")
    return StepResult(metrics=metrics, summary=summary)


KIND = StepKind("tokenize", EmptyConfig, run_tokenize, None, version="1", resources=phase("data"), tags=("data",),
                imports=TRANSFORMERS)
STEP_KINDS = (KIND,)
