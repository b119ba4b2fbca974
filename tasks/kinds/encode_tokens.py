"""Tokenize one curated source with the chosen tokenizer into memory-mappable arrays (model/token_files.py).

Tokenize steps are added on demand: a kind that trains or measures on a source asks for its tokens with
`tokens_of`, so a source nobody trains on is never tokenized.
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Iterator
from pathlib import Path

from compass.infra.layout import SPLITS, CuratedArtifact, TokenizerArtifact
from compass.tasks.data.tokenizer_files import tokenizer_ids
from compass.tasks.kinds.select_tokenizer import tokenizer_step
from compass.tasks.steps.context import StepContext, StepResult
from compass.tasks.steps.kind import TRANSFORMERS, EmptyConfig, PlanBuilder, StepKind
from compass.tasks.steps.placement import phase

BATCH = 256


def tokens_of(plan: PlanBuilder, source: str) -> str:
    """The id of the step that tokenizes `source`, added the first time it is asked for."""
    step_id = f"tokenize:{source}"
    if not plan.has(step_id):
        plan.add(KIND, source, EmptyConfig(), {"tokenizer": tokenizer_step(plan), "curated": f"curate:{source}"})
    return step_id


def data_inputs(plan: PlanBuilder, sources: list[str]) -> dict[str, str]:
    """Inputs of a step that trains on `sources`: the tokenizer, and each source's tokens as `tokens:<name>`."""
    return {"tokenizer": tokenizer_step(plan), **{f"tokens:{n}": tokens_of(plan, n) for n in sorted(sources)}}


def _texts(folder: Path) -> Iterator[str]:
    for shard in sorted(folder.glob("*.jsonl.gz")):
        with gzip.open(shard, "rt", encoding="utf-8") as f:
            for line in f:
                yield json.loads(line)["text"]


def _ids(tok, texts: Iterator[str]) -> Iterator[list[int]]:
    batch: list[str] = []
    for text in [*texts, None]:
        if text is not None:
            batch.append(text)
        if batch and (text is None or len(batch) == BATCH):
            yield from (enc.ids for enc in tok.encode_batch(batch))
            batch = []


def run_tokenize(ctx: StepContext[EmptyConfig]) -> StepResult:
    from tokenizers import Tokenizer

    from compass.model.training.token_files import token_dtype, write_meta, write_split

    tok_dir = TokenizerArtifact(ctx.inputs["tokenizer"].local()).chosen
    tok = Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
    eos = tokenizer_ids(tok_dir).eos
    dtype = token_dtype(tok.get_vocab_size())
    curated = CuratedArtifact(ctx.inputs["curated"].local())
    metrics: dict[str, int] = {}
    for split in SPLITS:
        documents, tokens = write_split(ctx.out, split, _ids(tok, _texts(curated.split(split))), eos, dtype)
        metrics[f"{split}_documents"] = documents
        metrics[f"{split}_tokens"] = tokens
    write_meta(ctx.out, dtype, eos, tok.get_vocab_size())
    summary = (f"### tokenize `{ctx.name}`\n\n{metrics['train_tokens']:,} training tokens in "
               f"{metrics['train_documents']:,} documents; {metrics['heldout_tokens']:,} held-out tokens")
    return StepResult(metrics=metrics, summary=summary)


KIND = StepKind("tokenize", EmptyConfig, run_tokenize, None, version="1", resources=phase("data"), tags=("data",),
                imports=TRANSFORMERS)
STEP_KINDS = (KIND,)
