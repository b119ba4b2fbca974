"""Each checkpoint's scores kept in the evaluate step's work folder (which survives a failed or requeued attempt),
keyed by the digest of the checkpoint's files: an attempt after a stop, a time limit or a crash scores only the
checkpoints no attempt scored yet. At SmolLM3's size an evaluate step scores ~170 exports; one that started from
zero on each retry would never finish inside its jobs' time limit."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from compass.infra.manifest import FileEntry
from compass.tasks.evaluation.scores import ItemScore


class ModelEvaluation(BaseModel):
    """One checkpoint's scores: the metrics by name, the table's rows, the benchmarks' provenance and every
    benchmark item as scored."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    metrics: dict[str, Any]
    rows: list[dict[str, Any]]
    provenance: list[dict[str, Any]]
    items: dict[str, list[ItemScore]] = Field(default_factory=dict)
    load_s: float = 0.0  # starting lighteval's ranks, preparing benchmarks, loading the model
    score_s: float = 0.0  # scoring: lighteval's evaluation, held-out losses, passkey retrieval


def folder_digest(entries: list[FileEntry], folder: str) -> str:
    """The digest of every committed file under `folder` of an artifact (weights, config, tokenizer), from its
    manifest's sha256s: the same files, the same digest, without reading a byte of them."""
    prefix = folder.rstrip("/") + "/"
    inside = sorted((e.path[len(prefix):], e.sha256) for e in entries if e.path.startswith(prefix))
    if not inside:
        raise FileNotFoundError(f"the artifact holds no file under {folder}/")
    return hashlib.sha256("".join(f"{path}\0{sha}\0" for path, sha in inside).encode()).hexdigest()


class ScoredCheckpoints:
    """The scores of the checkpoints this step has scored, one JSON file per checkpoint digest, each written
    whole (a temporary file renamed) so a killed attempt leaves either a record or none."""

    def __init__(self, folder: Path):
        self.folder = folder

    def _path(self, digest: str) -> Path:
        return self.folder / f"{digest[:32]}.json"

    def get(self, digest: str) -> ModelEvaluation | None:
        path = self._path(digest)
        if not path.exists():
            return None
        try:
            return ModelEvaluation.model_validate(json.loads(path.read_text()))  # NaN (a missing stderr) kept
        except ValueError:  # unreadable (a disk that filled mid-write): score it again
            return None

    def put(self, digest: str, evaluation: ModelEvaluation) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        path = self._path(digest)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(evaluation.model_dump()))  # Python's JSON: a NaN stays NaN, not null
        tmp.replace(path)

    def count(self) -> int:
        return len(list(self.folder.glob("*.json"))) if self.folder.is_dir() else 0
