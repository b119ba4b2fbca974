"""Checkpoints: written into a temporary folder, checksummed, then renamed into place (the checksum file is
the commit marker); verified on load; keep-last-K plus stage ends."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

from compass.infra.fingerprint import sha256_file

CHECKSUMS = "checksums.json"


class CheckpointCorrupt(RuntimeError):
    pass


def step_dir(root: Path, step: int) -> Path:
    return root / f"step-{step:08d}"


def rng_state() -> dict[str, Any]:
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])


def finalize(tmp: Path, final: Path) -> Path:
    """Checksum every file, write the checksum file last, and rename the folder into place."""
    files = sorted(p for p in tmp.rglob("*") if p.is_file())
    sums = {p.relative_to(tmp).as_posix(): sha256_file(str(p)) for p in files}
    (tmp / CHECKSUMS).write_text(json.dumps(sums, indent=1))
    if final.exists():
        shutil.rmtree(final)
    tmp.rename(final)
    return final


def is_complete(folder: Path) -> bool:
    return (folder / CHECKSUMS).exists()


def verify(folder: Path) -> None:
    sums = json.loads((folder / CHECKSUMS).read_text())
    for rel, digest in sums.items():
        path = folder / rel
        if not path.exists() or sha256_file(str(path)) != digest:
            raise CheckpointCorrupt(f"{path} does not match its checksum")


def complete_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoints, oldest first (incomplete temporary folders are ignored)."""
    if not root.exists():
        return []
    return sorted(p for p in root.glob("step-*") if p.is_dir() and p.name[5:].isdigit() and is_complete(p))


def newest_valid(root: Path) -> Path | None:
    """The newest checkpoint that verifies; a corrupt one is set aside and the next older one tried."""
    for folder in reversed(complete_checkpoints(root)):
        try:
            verify(folder)
            return folder
        except CheckpointCorrupt:
            folder.rename(folder.with_name(folder.name + ".corrupt"))
    return None


def prune(root: Path, keep_last: int, keep: set[int]) -> None:
    """Delete complete checkpoints beyond the newest `keep_last`, except the steps in `keep` (stage ends)."""
    done = complete_checkpoints(root)
    for folder in done[:-keep_last] if keep_last else done:
        if int(folder.name.split("-")[1]) not in keep:
            shutil.rmtree(folder)
    for leftover in root.glob("*.tmp"):
        shutil.rmtree(leftover, ignore_errors=True)
