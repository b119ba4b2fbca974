"""A model artifact's training history: `metrics.jsonl` (one line per optimizer step, every stage so far) and its
kept checkpoints. Every phase that continues a model reads how many tokens it has seen from here."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

METRICS = "metrics.jsonl"


def metric_rows(model_folder: Path) -> list[dict[str, Any]]:
    path = model_folder / METRICS
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line]


def tokens_seen(model_folder: Path) -> int | None:
    """Tokens the model has been trained on, over every stage so far (None: no history)."""
    rows = metric_rows(model_folder)
    return int(rows[-1]["tokens"]) if rows else None


def kept_checkpoints(model_folder: Path) -> list[tuple[str, Path, int | None]]:
    """(name, HF folder, tokens seen) of every checkpoint a model artifact kept, oldest first.

    Tokens come from the metrics of the artifact's own (last) stage: a checkpoint `step-N` holds the weights
    after that stage's step N."""
    rows = metric_rows(model_folder)
    stage = rows[-1]["stage"] if rows else None
    tokens_at = {r["stage_step"]: int(r["tokens"]) for r in rows if r["stage"] == stage and "stage_step" in r}
    found = sorted((model_folder / "checkpoints").glob("step-*")) if (model_folder / "checkpoints").exists() else []
    out = [(p.name, p, tokens_at.get(int(p.name.split("-")[1]))) for p in found]
    if not out:
        out = [("final", model_folder / "final", tokens_seen(model_folder))]
    return out
