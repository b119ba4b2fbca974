"""A model artifact's training history: its metrics (one line per optimizer step, every stage so far) and its
kept checkpoints. Every phase that continues a model reads how many tokens it has seen from here."""

from __future__ import annotations

from pathlib import Path

from compass.infra.layout import FINAL, ModelArtifact, checkpoint_step
from compass.model.training.records import MetricsRow, read_metrics


def metric_rows(model_folder: Path) -> list[MetricsRow]:
    return read_metrics(ModelArtifact(model_folder).metrics)


def tokens_seen(model_folder: Path) -> int | None:
    """Tokens the model has been trained on, over every stage so far (None: no history)."""
    rows = metric_rows(model_folder)
    return rows[-1].tokens if rows else None


def kept_checkpoints(model_folder: Path) -> list[tuple[str, Path, int | None]]:
    """(name, HF folder, tokens seen) of every checkpoint a model artifact kept, oldest first."""
    artifact = ModelArtifact(model_folder)
    names = [p.name for p in artifact.kept_checkpoints()]
    if not names:
        return [(FINAL, artifact.final, tokens_seen(model_folder))]
    return [(name, artifact.checkpoints / name, tokens) for name, tokens in checkpoint_tokens(model_folder, names)]


def checkpoint_tokens(model_folder: Path, names: list[str]) -> list[tuple[str, int | None]]:
    """(name, tokens seen) of the named checkpoints, oldest first, from the history alone (the checkpoints' own
    folders need not be on this disk). Tokens come from the metrics of the artifact's own (last) stage: a
    checkpoint `step-N` holds the weights after that stage's step N."""
    rows = metric_rows(model_folder)
    stage = rows[-1].stage if rows else None
    tokens_at = {r.stage_step: r.tokens for r in rows if r.stage == stage and r.stage_step is not None}
    ordered = sorted((n for n in names if checkpoint_step(n) is not None), key=lambda n: checkpoint_step(n) or 0)
    return [(name, tokens_at.get(checkpoint_step(name))) for name in ordered]
