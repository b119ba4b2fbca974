"""Tokenizer selection: train each BPE candidate on the curated training split, read local and hub candidates
from disk, measure fertility and the proportion of continued words per language/domain on held-out text, and
choose by the spec's rule."""

from __future__ import annotations

import bisect
import json
import re
import shutil
from collections.abc import Iterator, Mapping
from contextlib import ExitStack
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import BinaryIO

from compass.infra.environment import hub_cache
from compass.infra.layout import HELDOUT, SHARD_SUFFIX, TOKENIZER_FILES, TRAIN, TokenizerArtifact
from compass.specs.base import Issue
from compass.specs.spec import TrainingSpec
from compass.specs.tokenizer import HubCandidate, Tokenizer
from compass.tasks.data.shard_codec import open_shard
from compass.tasks.steps.context import InputArtifact, StepContext, StepResult
from compass.tasks.steps.kind import TRANSFORMERS, NodeFile, PlanBuilder, StepKind
from compass.tasks.steps.placement import phase
from compass.tasks.steps.step_config import StepConfig
from compass.tasks.steps.wiring import Inputs, R

_CODE_WORD = re.compile(r"[A-Za-z_][A-Za-z0-9_]*|\d+|[^\sA-Za-z0-9_]")
_HAS_ALNUM = re.compile(r"\w")
SAMPLED_SHARDS = 64  # shards a source's sample is drawn from, spread over all of them


class TokenizerConfig(Tokenizer, StepConfig):
    """The spec's `what.tokenizer`, whole: candidates, training and held-out budgets, the selection rule."""


@dataclass(frozen=True)
class Doc:
    text: str
    group: str  # language code for natural language, "code" for code


@dataclass(frozen=True)
class SelectionInputs(Inputs[R]):
    curated: Mapping[str, R]  # every curated source: candidates train and are measured on them


def build(plan: PlanBuilder) -> None:
    if plan.spec.what.tokenizer is None:  # the starting checkpoint's (tasks/kinds/base_model.py)
        return
    curated = {s.name: s.ref for s in plan.of_kind("curate")}
    plan.add(KIND, "select", TokenizerConfig(**dict(plan.spec.what.tokenizer)), SelectionInputs(curated))


class HubTokenizerMissing(FileNotFoundError):
    pass


def hub_snapshot(candidate: HubCandidate) -> Path:
    """The candidate's folder in the local Hugging Face cache (HF_HUB_CACHE); nothing is downloaded."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError


    try:
        folder = Path(snapshot_download(candidate.repo, revision=candidate.revision, local_files_only=True,
                                        allow_patterns=list(TOKENIZER_FILES), cache_dir=hub_cache()))
    except (LocalEntryNotFoundError, FileNotFoundError, ValueError) as exc:
        raise HubTokenizerMissing(str(exc)) from None
    if not (folder / "tokenizer.json").exists():
        raise HubTokenizerMissing(f"{folder} has no tokenizer.json")
    return folder


def check_machine(spec: TrainingSpec, base_dir: Path) -> Iterator[Issue]:
    """Local candidates must be folders with a tokenizer.json; hub candidates must be in the local cache, with the
    vocabulary the spec declares (the planner sizes the embedding and its costs from the declaration)."""

    for i, c in enumerate(spec.what.tokenizer.candidates if spec.what.tokenizer else []):
        at = ("what", "tokenizer", "candidates", i)
        if c.kind == "local" and not (base_dir / c.path / "tokenizer.json").expanduser().exists():
            yield Issue((*at, "path"), f"no tokenizer.json in '{c.path}' (relative to {base_dir})",
                        "point to a folder saved with save_pretrained()")
        if c.kind == "hub":
            try:
                cached = cached_vocab_size(c)
            except HubTokenizerMissing:
                yield Issue((*at, "repo"), f"the tokenizer '{c.repo}' (revision {c.revision}) is not in the local "
                            f"Hugging Face cache ({hub_cache()}) and cannot be downloaded offline",
                            f"on a machine with network run `hf download {c.repo} {' '.join(TOKENIZER_FILES)} "
                            f"--revision {c.revision}` and copy its hub cache to {hub_cache()} (or set HF_HUB_CACHE)")
                continue
            if cached != c.vocab_size:
                yield Issue((*at, "vocab_size"), f"declares {c.vocab_size} tokens, and the cached tokenizer "
                            f"'{c.repo}' (revision {c.revision}, in {hub_cache()}) has {cached}",
                            f"set vocab_size: {cached}, or cache the revision the spec means")


def cached_vocab_size(candidate: HubCandidate) -> int:
    """Tokens of the hub candidate's cached tokenizer, its added special tokens included (what an embedding must
    hold)."""
    path = hub_snapshot(candidate) / "tokenizer.json"
    return _vocabulary_size(str(path), path.stat().st_mtime_ns)


@lru_cache(maxsize=16)
def _vocabulary_size(path: str, _mtime_ns: int) -> int:
    """Read once per process and file version: a run validates its spec more than once, and Llama 3's tokenizer
    takes most of a second to load."""
    from tokenizers import Tokenizer as Loaded

    return Loaded.from_file(path).get_vocab_size(with_added_tokens=True)


def with_cached_vocabularies(spec: TrainingSpec) -> tuple[TrainingSpec, list[tuple[int, int, int]]]:
    """A smoke or rehearsal spec whose hub candidates declare their cached tokenizers' sizes (a stand-in cached in
    place of the real one is what a small run on this machine can use), and each change: (candidate index,
    declared, cached). A full run keeps its declarations, and check_machine refuses a mismatch."""
    tokenizer = spec.what.tokenizer
    changes: list[tuple[int, int, int]] = []
    candidates = list(tokenizer.candidates) if tokenizer else []
    for i, c in enumerate(candidates):
        if c.kind != "hub":
            continue
        try:
            cached = cached_vocab_size(c)
        except HubTokenizerMissing:  # check_machine's error
            continue
        if cached != c.vocab_size:
            changes.append((i, c.vocab_size, cached))
            candidates[i] = c.model_copy(update={"vocab_size": cached})
    if not changes:
        return spec, changes
    what = spec.what.model_copy(update={"tokenizer": tokenizer.model_copy(update={"candidates": candidates})})
    return spec.model_copy(update={"what": what}), changes


def node_files(spec: TrainingSpec) -> Iterator[NodeFile]:
    """Each hub candidate's snapshot in the Hugging Face cache (one this machine lacks is check_machine's error)."""
    for i, c in enumerate(spec.what.tokenizer.candidates if spec.what.tokenizer else []):
        if c.kind == "hub":
            try:
                yield NodeFile(("what", "tokenizer", "candidates", i, "repo"),
                               f"the tokenizer {c.repo} in the Hugging Face cache", hub_snapshot(c))
            except HubTokenizerMissing:
                continue


def run_tokenizer_selection(ctx: StepContext[TokenizerConfig]) -> StepResult:
    from tokenizers import Tokenizer as FastTokenizer

    cfg = ctx.config
    curated = ctx.given(SelectionInputs).curated
    trains = any(cand.kind == "bpe" for cand in cfg.candidates)  # only a trained candidate reads training text
    train_docs = list(_balanced(curated, TRAIN, cfg.train_chars)) if trains else []
    heldout = _heldout_by_group(curated, cfg.eval_chars)
    if not heldout:
        raise ValueError("no held-out documents: raise curation.heldout_fraction on some source")
    ctx.log.info("tokenizer: training on %d documents (%d chars); held-out groups %s", len(train_docs),
                 sum(len(d.text) for d in train_docs), sorted(heldout))

    results = []
    for cand in cfg.candidates:
        folder = TokenizerArtifact(ctx.out).candidates / cand.key
        if cand.kind == "bpe":
            tok = _train_bpe(train_docs, cand.vocab_size, cand.min_frequency, cfg.special_tokens)
            _save_hf(tok, folder, cfg.special_tokens)
        else:
            if cand.kind == "local":
                shutil.copytree((ctx.runtime.base_dir / cand.path).expanduser(), folder)
            else:
                snapshot = hub_snapshot(cand)
                folder.mkdir(parents=True)
                for name in TOKENIZER_FILES:
                    if (snapshot / name).exists():
                        shutil.copy(snapshot / name, folder / name)
            tok = FastTokenizer.from_file(str(folder / "tokenizer.json"))
        per_group = {g: _measure(tok, docs, g) for g, docs in sorted(heldout.items())}
        mean_fertility = sum(m["fertility"] for m in per_group.values()) / len(per_group)
        results.append({"candidate": cand.key, "vocab_size": tok.get_vocab_size(), "mean_fertility": mean_fertility,
                        "groups": per_group})

    chosen = _choose(results, cfg.selection.rule, cfg.selection.tolerance)
    out = TokenizerArtifact(ctx.out)
    shutil.copytree(out.candidates / chosen["candidate"], out.chosen)
    out.comparison.write_text(json.dumps({"chosen": chosen["candidate"], "results": results},
                                                        indent=2))
    rows = []
    for r in results:
        row = {"candidate": r["candidate"], "vocab": r["vocab_size"], "mean fertility": round(r["mean_fertility"], 3)}
        for g, m in r["groups"].items():
            row[f"{g} fertility"] = round(m["fertility"], 3)
            row[f"{g} continued %"] = round(100 * m["continued"], 1)
        row["chosen"] = "yes" if r is chosen else ""
        rows.append(row)
    rule = cfg.selection.rule
    summary = (f"### tokenizer selection\n\nchosen **{chosen['candidate']}** by `{rule}` "
               f"(mean fertility {chosen['mean_fertility']:.3f} tokens/word over {', '.join(heldout)})")
    metrics = {"chosen": chosen["candidate"], "vocab_size": chosen["vocab_size"],
               "mean_fertility": chosen["mean_fertility"],
               "candidates": {r["candidate"]: round(r["mean_fertility"], 4) for r in results}}
    return StepResult(metrics=metrics, summary=summary, tables={"tokenizer-comparison": rows})


def _choose(results: list[dict], rule: str, tolerance: float) -> dict:
    best = min(results, key=lambda r: r["mean_fertility"])
    if rule == "lowest_fertility":
        return best
    limit = best["mean_fertility"] * (1 + tolerance)
    within = [r for r in results if r["mean_fertility"] <= limit]
    return min(within, key=lambda r: (r["vocab_size"], r["mean_fertility"]))


def _group_of(meta: dict) -> str:
    return "code" if meta.get("domain") == "code" else (meta.get("language") or meta.get("domain") or "other")


def _read(curated: InputArtifact, split: str) -> Iterator[Doc]:
    """A source's documents drawn across its shards: round-robin over up to SAMPLED_SHARDS shards spread evenly
    over the shard list, so a sample of a few million characters sees the whole source, not its first shard, and
    opens a bounded number of files whatever the shard count. Shards are streamed from the store, never copied."""
    shards = curated.files(split, SHARD_SUFFIX)
    if len(shards) > SAMPLED_SHARDS:
        shards = [shards[i * len(shards) // SAMPLED_SHARDS] for i in range(SAMPLED_SHARDS)]
    with ExitStack() as opened:
        streams = [_documents(opened.enter_context(curated.open(shard))) for shard in shards]
        while streams:
            for stream in list(streams):
                doc = next(stream, None)
                if doc is None:
                    streams.remove(stream)
                else:
                    yield doc


def _documents(raw: BinaryIO) -> Iterator[Doc]:
    with open_shard(raw) as f:
        for line in f:
            d = json.loads(line)
            yield Doc(d["text"], _group_of(d.get("metadata", {})))


def _balanced(curated: dict, split: str, budget: int) -> Iterator[Doc]:
    """Round-robin over sources so no single source dominates the tokenizer's training text."""
    streams = [_read(art, split) for _, art in sorted(curated.items())]
    used = 0
    while streams and used < budget:
        for stream in list(streams):
            doc = next(stream, None)
            if doc is None:
                streams.remove(stream)
                continue
            used += len(doc.text)
            yield doc


def _heldout_by_group(curated: dict, budget: int) -> dict[str, list[str]]:
    """Up to `budget` characters of held-out text per language/domain group; a source is read only until every
    group it has shown is full."""
    groups: dict[str, list[str]] = {}
    used: dict[str, int] = {}
    for _, art in sorted(curated.items()):
        seen: set[str] = set()
        for doc in _read(art, HELDOUT):
            seen.add(doc.group)
            if used.get(doc.group, 0) < budget:
                groups.setdefault(doc.group, []).append(doc.text)
                used[doc.group] = used.get(doc.group, 0) + len(doc.text)
            elif all(used.get(g, 0) >= budget for g in seen):
                break
    return groups


def _train_bpe(docs: list[Doc], vocab_size: int, min_frequency: int, special: list[str]):
    from tokenizers import Tokenizer as FastTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = FastTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency, special_tokens=special,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator((d.text for d in docs), trainer=trainer, length=len(docs))
    return tok


def _save_hf(tok, folder: Path, special: list[str]) -> None:
    from transformers import PreTrainedTokenizerFast

    eos = special[0]
    pad = special[1] if len(special) > 1 else special[0]
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=eos, eos_token=eos, pad_token=pad,
                                 unk_token=None)
    hf.save_pretrained(str(folder))


def _word_spans(text: str, group: str) -> list[tuple[int, int]]:
    """Word boundaries: datatrove's word tokenizer for the language, identifiers and symbols for code."""
    if group == "code":
        return [m.span() for m in _CODE_WORD.finditer(text) if _HAS_ALNUM.search(m.group())]
    from datatrove.utils.word_tokenizers import load_word_tokenizer

    try:
        words = load_word_tokenizer(group).word_tokenize(text)
    except ValueError:  # no tokenizer for this language: whitespace words
        words = text.split()
    spans, cursor = [], 0
    for w in words:
        start = text.find(w, cursor)
        if start < 0 or not _HAS_ALNUM.search(w):
            continue
        spans.append((start, start + len(w)))
        cursor = start + len(w)
    return spans


def _measure(tok, texts: list[str], group: str) -> dict[str, float]:
    """Fertility = tokens per word; continued = share of words split over more than one token."""
    n_tokens = n_words = n_continued = 0
    for text in texts:
        enc = tok.encode(text)
        starts = [s for s, _ in enc.offsets]
        ends = [e for _, e in enc.offsets]
        n_tokens += len(enc.ids)
        for ws, we in _word_spans(text, group):
            first = bisect.bisect_right(ends, ws)   # first token ending after the word starts
            last = bisect.bisect_left(starts, we)   # tokens starting before the word ends
            n_words += 1
            n_continued += (last - first) > 1
    return {"fertility": n_tokens / max(1, n_words), "continued": n_continued / max(1, n_words),
            "words": n_words, "tokens": n_tokens}


KIND = StepKind("tokenizer", TokenizerConfig, run_tokenizer_selection, build, version="2", resources=phase("data"),
                imports=TRANSFORMERS, check_machine=check_machine, node_files=node_files,
                inputs=SelectionInputs, after=("curate",), provides_tokenizer=True,
                headline=("chosen", "mean_fertility"))
STEP_KINDS = (KIND,)
