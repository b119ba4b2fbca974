"""What each training step copies onto a node's local disk (how.storage.local_cache), from the spec alone.

A stage reads a window of each source sized from the tokens it draws (steps x global batch x sequence length x
the source's weight) with a margin (model/training/windows.py), and each node copies the token shards of its
ranks' rows of that window (model/training/staging.py): a node's share is the window's bytes over the phase's
nodes. The corpus's size is not known before tokenization, so this is an upper bound (a window never exceeds its
source); shard boundaries add up to a shard per source and node. The step's resource ledger counts what it copied
(`copied_by_node`), so a run can be held to this (tests/test_scale_staging.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from compass.specs.costs import PHASE_OF_SECTION, planning_vocab
from compass.specs.how import Phase
from compass.specs.post_training import MidTraining
from compass.specs.spec import TrainingSpec

WINDOW_MARGIN = 1.25  # documents beyond a stage's expected draw (model/training/windows.py reads it)
GIB = 1024**3


def token_bytes(vocab: int) -> int:
    """Bytes of one stored token id (uint16 up to 65,535 ids, else uint32: model/training/token_files.py)."""
    return 2 if vocab <= 65535 else 4


def staged_bytes(tokens: float, vocab: int, nodes: int) -> float:
    """Bytes one node of `nodes` copies for a stage drawing `tokens` tokens (its window's share)."""
    return tokens * WINDOW_MARGIN * token_bytes(vocab) / max(1, nodes)


@dataclass(frozen=True)
class StagingCost:
    step: str
    phase: Phase
    tokens: float  # the stage's draw
    nodes: int  # the nodes its rows are spread over
    per_node: float  # bytes copied onto each of them


def staging_costs(spec: TrainingSpec) -> list[StagingCost]:
    """Every step that stages its data, with what each of its nodes copies; none without how.storage.local_cache."""
    how = spec.how
    if how.storage.local_cache is None:
        return []
    vocab = planning_vocab(spec)
    stages: list[tuple[str, str, float]] = [("pretrain", s.name, s.tokens) for s in spec.what.pretraining.stages]
    stages += [("long_context", s.name, s.tokens) for s in spec.what.long_context.stages]
    stages += [("mid_training", s.name, s.tokens) for s in spec.what.post_training if isinstance(s, MidTraining)]
    out = []
    for section, name, tokens in stages:
        phase = PHASE_OF_SECTION[section]
        nodes = how.shape(phase).nodes
        out.append(StagingCost(f"{section}:{name}", phase, tokens, nodes, staged_bytes(tokens, vocab, nodes)))
    abl = spec.what.ablations
    if abl is not None:  # every run of the ablation draws the baseline's tokens on its own nodes
        nodes = how.shape("ablation").nodes
        out.append(StagingCost("ablate:*", "ablation", abl.baseline.tokens, nodes,
                               staged_bytes(abl.baseline.tokens, vocab, nodes)))
    return out


def over_capacity(spec: TrainingSpec) -> list[StagingCost]:
    """The steps whose nodes would copy more than how.storage.local_cache_gib."""
    capacity = spec.how.storage.local_cache_gib
    if capacity is None:
        return []
    return [c for c in staging_costs(spec) if c.per_node > capacity * GIB]
