"""A dataset in the Hugging Face hub cache's own layout, as `hf download --repo-type dataset` leaves it: how a
user brings a standard lighteval task's data to a machine without network."""

from __future__ import annotations

from pathlib import Path
from typing import Any

COMMIT = "c0" * 20


def seed_dataset(cache: Path, repo: str, subset: str, splits: dict[str, Any]) -> Path:
    """Write `splits` (name -> datasets.Dataset) as parquet under the repo's snapshot; returns the snapshot."""
    folder = cache / f"datasets--{repo.replace('/', '--')}"
    snapshot = folder / "snapshots" / COMMIT
    (snapshot / subset).mkdir(parents=True, exist_ok=True)
    files = []
    for split, data in splits.items():
        data.to_parquet(str(snapshot / subset / f"{split}-00000-of-00001.parquet"))
        files.append(f"  - split: {split}\n    path: {subset}/{split}-*\n")
    (snapshot / "README.md").write_text(f"---\nconfigs:\n- config_name: {subset}\n  data_files:\n{''.join(files)}---\n")
    (folder / "refs").mkdir(exist_ok=True)
    (folder / "refs" / "main").write_text(COMMIT)
    return snapshot


def seed_model(cache: Path, repo: str, files: Path) -> Path:
    """Place the files of `files` (a folder) as the snapshot of model repo `repo`, as `hf download REPO` would."""
    import shutil

    folder = cache / f"models--{repo.replace('/', '--')}"
    snapshot = folder / "snapshots" / COMMIT
    shutil.copytree(files, snapshot)
    (folder / "refs").mkdir(parents=True, exist_ok=True)
    (folder / "refs" / "main").write_text(COMMIT)
    return snapshot
