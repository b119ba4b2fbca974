"""The decontamination fence: every benchmark item the spec evaluates, indexed as word n-grams the way GPT-3, OLMo's
decon and datatrove's NGramsDecontIndexer do, and any text matched against it.

Text is normalized by datatrove's own utilities (simplify_text, its xxhash n-gram hashes) and split on
whitespace; numbers are kept (arithmetic items are made of them). An item is indexed as the n-grams of
its question, and of its question running into its gold answer; an item shorter than n words but at least
SHORT_MIN words long is indexed whole, through the hash of its first SHORT_MIN words and then compared word by word.
Shorter items cannot be matched reliably in running text and are counted apart (`unmatchable`).

Problem sets (GRPO and verifier prompts) are compared item for item: a problem equal to a benchmark question (after
normalization, operators kept) is a hit however short it is.
"""

from __future__ import annotations

import io
import json
import re
import unicodedata
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

SHORT_MIN = 6  # words: an item at least this long is matched whole when it is shorter than n
INDEX = "index.npz"
PROBLEMS = "problems.npz"
ITEMS = "items.jsonl"


@dataclass(frozen=True)
class BenchmarkItem:
    """One item a benchmark scores, as the fence indexes it (tasks/evaluation/benchmark_items.py reads them)."""

    benchmark: str  # the benchmark's metric prefix: arc_easy:cf, lighteval:winogrande
    query: str
    golds: tuple[str, ...]


def _text_tools():
    """datatrove's normalization (lowercase, punctuation and diacritics out, whitespace collapsed) and its 64-bit
    xxhash, then words split on whitespace: the normalized text has no punctuation left for a word tokenizer to
    split, and datatrove's spaCy tokenizer took ~2 ms per text (40 s to index MMLU and HellaSwag)."""
    from datatrove.utils.hashing import HashConfig, create_hash_func
    from datatrove.utils.text import TextNormConfig, simplify_text

    norm = TextNormConfig(norm_numbers=False)
    hash_of = create_hash_func(HashConfig())

    def words(text: str) -> list[str]:
        return simplify_text(folded(text), norm).split()

    return words, hash_of


def folded(text: str) -> str:
    """`text` in Unicode's compatibility form (NFKC: fullwidth and styled letters as plain ones) without format
    characters (zero-width spaces and joiners, soft hyphens, word joiners, byte-order marks): a benchmark question
    with a zero-width space inside each word matched none of its n-grams, and datatrove's normalization keeps
    them."""
    return "".join(c for c in unicodedata.normalize("NFKC", text) if unicodedata.category(c) != "Cf")


def problem_key(text: str) -> str:
    """A problem's identity for item-for-item comparison: folded, lowercased, whitespace collapsed, operators
    kept."""
    return re.sub(r"\s+", " ", folded(text).strip().lower())


@dataclass(frozen=True)
class Hit:
    benchmark: str
    item: int  # index into the fence's items
    matched: str  # the words that matched


@dataclass
class Fence:
    """The index: n-gram hash -> item, first-SHORT_MIN-words hash -> short items, problem key -> item."""

    n: int
    items: list[dict[str, Any]] = field(default_factory=list)  # benchmark, query (shortened), words of short items
    ngrams: dict[int, int] = field(default_factory=dict)
    heads: dict[int, list[int]] = field(default_factory=dict)
    problems: dict[int, int] = field(default_factory=dict)  # hash of a question's problem_key -> item
    unmatchable: dict[str, int] = field(default_factory=dict)  # benchmark -> items too short to match in text

    @classmethod
    def build(cls, items: Iterable[BenchmarkItem], n: int) -> Fence:
        words_of, hash_of = _text_tools()
        fence = cls(n)
        for item in items:
            at = len(fence.items)
            query = words_of(item.query)
            record: dict[str, Any] = {"benchmark": item.benchmark, "query": item.query[:300]}
            fence.problems.setdefault(hash_of(problem_key(item.query)), at)
            matchable = False
            for gold in item.golds or ("",):
                whole = query + words_of(gold)
                sequences = [query, whole] if len(query) >= n else [whole]
                for seq in sequences:
                    for i in range(len(seq) - n + 1):
                        fence.ngrams.setdefault(hash_of(" ".join(seq[i:i + n])), at)
                        matchable = True
                if len(whole) < n and len(whole) >= SHORT_MIN:
                    record.setdefault("short", []).append(whole)
                    fence.heads.setdefault(hash_of(" ".join(whole[:SHORT_MIN])), []).append(at)
                    matchable = True
            if not matchable:
                fence.unmatchable[item.benchmark] = fence.unmatchable.get(item.benchmark, 0) + 1
            fence.items.append(record)
        return fence

    def counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for item in self.items:
            out[item["benchmark"]] = out.get(item["benchmark"], 0) + 1
        return out

    def write(self, folder: Path) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        heads = [(h, i) for h, items in self.heads.items() for i in items]
        np.savez(folder / INDEX, n=np.array([self.n]),
                 ngram_hashes=np.fromiter(self.ngrams.keys(), np.uint64, len(self.ngrams)),
                 ngram_items=np.fromiter(self.ngrams.values(), np.uint32, len(self.ngrams)),
                 head_hashes=np.array([h for h, _ in heads], np.uint64),
                 head_items=np.array([i for _, i in heads], np.uint32))
        with (folder / ITEMS).open("w", encoding="utf-8") as f:
            for item in self.items:
                f.write(json.dumps(item) + "\n")
        (folder / "fence.json").write_text(json.dumps({"n": self.n, "unmatchable": self.unmatchable}))
        np.savez(folder / PROBLEMS, hashes=np.fromiter(self.problems.keys(), np.uint64, len(self.problems)),
                 items=np.fromiter(self.problems.values(), np.uint32, len(self.problems)))

    @classmethod
    def read(cls, folder: str | Path) -> Fence:
        """From a local folder or a store URL (s3://...: the ranks of a remote store's tokenize read it there)."""

        import fsspec

        def content(name: str) -> bytes:
            with fsspec.open(f"{str(folder).rstrip('/')}/{name}", "rb") as f:
                return f.read()

        arrays = np.load(io.BytesIO(content(INDEX)))
        meta = json.loads(content("fence.json"))
        fence = cls(int(arrays["n"][0]), unmatchable=meta["unmatchable"])
        problems = np.load(io.BytesIO(content(PROBLEMS)))
        fence.problems = dict(zip(problems["hashes"].tolist(), problems["items"].tolist(), strict=True))
        fence.items = [json.loads(line) for line in content(ITEMS).decode("utf-8").splitlines()]
        fence.ngrams = dict(zip(arrays["ngram_hashes"].tolist(), arrays["ngram_items"].tolist(), strict=True))
        for h, i in zip(arrays["head_hashes"].tolist(), arrays["head_items"].tolist(), strict=True):
            fence.heads.setdefault(h, []).append(i)
        return fence


class Matcher:
    """Matches texts against a fence (one per process: the tokenizer and hash function are built once)."""

    def __init__(self, fence: Fence):
        self.fence = fence
        self.words, self.hash_of = _text_tools()

    def match(self, text: str) -> Hit | None:
        fence, hash_of = self.fence, self.hash_of
        words = self.words(text)
        n = fence.n
        for i in range(len(words) - n + 1):
            gram = " ".join(words[i:i + n])
            item = fence.ngrams.get(hash_of(gram))
            if item is not None:
                return Hit(fence.items[item]["benchmark"], item, gram)
        if fence.heads:
            for i in range(len(words) - SHORT_MIN + 1):
                for item in fence.heads.get(hash_of(" ".join(words[i:i + SHORT_MIN])), ()):
                    for whole in fence.items[item].get("short", ()):
                        if words[i:i + len(whole)] == whole:
                            return Hit(fence.items[item]["benchmark"], item, " ".join(whole))
        return None

    def match_problem(self, question: str) -> Hit | None:
        """A problem (GRPO, verifier pairs) equal to a benchmark question, else any n-gram match."""
        item = self.fence.problems.get(self.hash_of(problem_key(question)))
        if item is not None:
            return Hit(self.fence.items[item]["benchmark"], item, question.strip())
        return self.match(question)


@dataclass
class SourceReport:
    """Hits in one training source: documents (or examples) scanned, matched per benchmark, a few examples."""

    source: str
    scanned: int = 0
    matched: dict[str, int] = field(default_factory=dict)
    items: dict[str, set[int]] = field(default_factory=dict)
    examples: list[dict[str, str]] = field(default_factory=list)

    def add(self, hit: Hit | None, document: str, fence: Fence, keep_examples: int = 3) -> None:
        self.scanned += 1
        if hit is None:
            return
        self.matched[hit.benchmark] = self.matched.get(hit.benchmark, 0) + 1
        self.items.setdefault(hit.benchmark, set()).add(hit.item)
        if sum(e["benchmark"] == hit.benchmark for e in self.examples) < keep_examples:
            self.examples.append({"benchmark": hit.benchmark, "document": document, "matched": hit.matched,
                                  "item": fence.items[hit.item]["query"]})

    def merge(self, other: SourceReport) -> None:
        self.scanned += other.scanned
        for b, k in other.matched.items():
            self.matched[b] = self.matched.get(b, 0) + k
        for b, ids in other.items.items():
            self.items.setdefault(b, set()).update(ids)
        self.examples += other.examples

    def as_json(self) -> dict[str, Any]:
        return {"source": self.source, "scanned": self.scanned, "matched": self.matched,
                "items": {b: len(ids) for b, ids in self.items.items()}, "examples": self.examples[:9]}

    @classmethod
    def of_json(cls, data: dict[str, Any]) -> SourceReport:
        """A rank's report read back (item ids as a list)."""
        report = cls(data["source"], data["scanned"], data["matched"], examples=data["examples"])
        report.items = {b: set(ids) for b, ids in data["item_ids"].items()}
        return report
