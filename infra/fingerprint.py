"""Step identity: a sha256 over what determines a step's output, and nothing else."""

import hashlib
import json
from pathlib import Path
from typing import Any


def canonical_json(value: Any) -> str:
    """JSON with sorted keys and no whitespace, so equal configs hash equally."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str)


def fingerprint(kind: str, config: dict[str, Any], input_fingerprints: dict[str, str], code_version: str,
                how: dict[str, Any] | None = None) -> str:
    """`how`: the values of the `how` fields that change this step's output (a kind that reads none leaves them
    out, so its identity is what it was before `how` entered identities)."""
    identity: dict[str, Any] = {"kind": kind, "config": config, "inputs": input_fingerprints,
                                "code_version": code_version}
    if how:
        identity["how"] = how
    payload = canonical_json(identity)
    return hashlib.sha256(payload.encode()).hexdigest()


def weights_digest(folder: Path) -> str:
    """sha256 over a checkpoint folder's safetensors files in name order: the same weights, the same digest."""
    digest = hashlib.sha256()
    for path in sorted(folder.glob("*.safetensors")):
        with path.open("rb") as f:
            while chunk := f.read(1 << 22):
                digest.update(chunk)
    return digest.hexdigest()


def sha256_file(path: str, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()
