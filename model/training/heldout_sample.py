"""The part of a held-out split that is scored: enough shards, spread over the split, to hold a fixed token budget.

Held-out losses score 16 sequences and passkey retrieval draws its haystack from the same split. Reading the whole
split for that grows with the corpus: at SmolLM3's size a source's 5% held out is ~100B tokens, copied from S3 by
every evaluate step (and mapped by every training rank) to score ~1M of them. The sample is chosen from the split's
counts alone (`<split>.counts.json`), shards taken in an order that spreads them over the split (0, 1/2, 1/4, 3/4,
... of the way through: a sample of the early crawl alone would not represent a source), until they hold
SAMPLE_TOKENS; below that size the sample is the whole split, in order, so a small run scores exactly the documents
it scored before. The trainer's validation and the evaluate step take the same sample, so their numbers stay
comparable, and the evaluate step copies only its shards (tasks/evaluation/heldout_reads.py)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np

from compass.model.training.token_files import META, TokenizedSource, counts_path, shard_paths

SAMPLE_TOKENS = 2**21  # 16 sequences of 128k tokens: the most any held-out loss or haystack here reads


def _spread(n: int) -> Iterator[int]:
    """0..n-1, each once, in an order whose every prefix is spread over the range."""
    seen: set[int] = set()
    denominator = 1
    while len(seen) < n and denominator <= 4 * n:
        for numerator in range(0 if denominator == 1 else 1, denominator, 2):
            i = numerator * n // denominator
            if i not in seen:
                seen.add(i)
                yield i
        denominator *= 2
    yield from (i for i in range(n) if i not in seen)


def sampled_shards(tokens_per_shard: Sequence[int], budget: int = SAMPLE_TOKENS) -> list[int]:
    """The shards of the sample, in index order: taken spread over the split until they hold `budget` tokens
    (every shard when the split holds fewer)."""
    chosen: list[int] = []
    held = 0
    for i in _spread(len(tokens_per_shard)):
        if held >= budget:
            break
        if tokens_per_shard[i] > 0:
            chosen.append(i)
            held += tokens_per_shard[i]
    return sorted(chosen)


def sample_files(split: str, shards: Sequence[int]) -> set[str]:
    """The artifact-relative files reading the sample takes: the metadata, the split's counts, its shards."""
    files = {META, counts_path(Path(), split).as_posix()}
    for shard in shards:
        files.update(p.as_posix() for p in shard_paths(Path(), split, shard))
    return files


class HeldoutSample:
    """The sampled shards of a split as one document index (what the packer and the haystack read)."""

    def __init__(self, source: TokenizedSource, budget: int = SAMPLE_TOKENS):
        counts = source.shard_counts
        self.source = source
        self.shards = sampled_shards([tokens for _, tokens in counts], budget)
        self._starts = [source.first_document(s) for s in self.shards]
        self._first = np.concatenate([[0], np.cumsum([counts[s][0] for s in self.shards], dtype=np.int64)])
        self.n_tokens = sum(counts[s][1] for s in self.shards)

    @property
    def n_documents(self) -> int:
        return int(self._first[-1])

    def document(self, i: int) -> np.ndarray:
        k = int(np.searchsorted(self._first, i, side="right")) - 1
        return self.source.document(self._starts[k] + i - int(self._first[k]))

    @property
    def tokens(self) -> np.ndarray:
        """The sample's tokens in one array (a passkey haystack)."""
        parts = [self.source.shard_tokens(s) for s in self.shards]
        return np.concatenate(parts) if parts else np.zeros(0, self.source.dtype)
