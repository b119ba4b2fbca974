"""Which documents of each source a training stage reads: a window of its document index sized from what the stage
draws from it (its steps x global batch x sequence length x the source's weight, with a margin), each stage of a
schedule starting where the previous stage's window of that source ended.

Rows read contiguous blocks of the window (model/training/packing.py), so what a node stages and what a run reads
grow with the tokens it trains on, not with the corpus: a 45B-token ablation of a 10T-token corpus stages ~56B
tokens on its one node instead of every shard. A window larger than its source is the whole source (as before).
The window is computed from the recipe and the sources' counts alone, so a staged and an unstaged run read the
same documents.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from compass.model.training.job import StageRecipe
from compass.model.training.schedules import schedule_shape
from compass.specs.staging_costs import WINDOW_MARGIN
from compass.specs.training import PretrainStage


@dataclass(frozen=True)
class SourceSize:
    """A source's training split: documents and tokens (its counts file)."""

    documents: int
    tokens: int


@dataclass(frozen=True)
class Window:
    """Documents `first`, `first + 1`, ... (`documents` of them, wrapping around the source's end)."""

    first: int
    documents: int

    def index(self, i: int, total: int) -> int:
        """The source's document index of the window's `i`-th document."""
        return (self.first + i) % total if total else 0


def whole(size: SourceSize) -> Window:
    return Window(0, size.documents)


def drawn_tokens(stage: PretrainStage, steps: int) -> dict[str, float]:
    """Tokens the stage draws from each source of its mixture over `steps` steps."""
    total = sum(stage.mixture.values())
    tokens = steps * stage.global_batch_size * stage.sequence_length
    return {name: tokens * weight / total for name, weight in stage.mixture.items()}


def window_of(size: SourceSize, tokens: float, rows: int, first: int) -> Window:
    """The window holding `tokens` (with the margin) of a source, at least one document per row."""
    if size.documents == 0 or size.tokens == 0:
        return whole(size)
    needed = max(rows, math.ceil(tokens / (size.tokens / size.documents) * WINDOW_MARGIN))
    if needed >= size.documents:
        return whole(size)
    return Window(first % size.documents, needed)


def stage_windows(recipe: StageRecipe, sizes: Mapping[str, SourceSize]) -> dict[str, Window]:
    """The current stage's window of each source in `sizes` (a source missing there is read whole)."""
    shape = schedule_shape(recipe.schedule, recipe.stages)
    first = dict.fromkeys(sizes, 0)
    for stage, steps in zip(recipe.stages, shape.stages, strict=True):
        windows = {name: window_of(sizes[name], tokens, stage.global_batch_size, first[name])
                   for name, tokens in drawn_tokens(stage, steps.steps).items() if name in sizes}
        if stage.name == recipe.stage:
            return windows
        for name, window in windows.items():
            first[name] = window.first + window.documents
    raise ValueError(f"stage {recipe.stage!r} is not among the recipe's stages")
