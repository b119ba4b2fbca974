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
    """(name, HF folder, tokens seen) of every checkpoint a model artifact kept, oldest first.

    Tokens come from the metrics of the artifact's own (last) stage: a checkpoint `step-N` holds the weights
    after that stage's step N."""
    artifact = ModelArtifact(model_folder)
    rows = metric_rows(model_folder)
    stage = rows[-1].stage if rows else None
    tokens_at = {r.stage_step: r.tokens for r in rows if r.stage == stage and r.stage_step is not None}
    out = [(p.name, p, tokens_at.get(checkpoint_step(p.name))) for p in artifact.kept_checkpoints()]
    if not out:
        out = [(FINAL, artifact.final, tokens_seen(model_folder))]
    return out
