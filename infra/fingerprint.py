"""Step identity: a sha256 over what determines a step's output, and nothing else."""

import hashlib
import json
from typing import Any


def canonical_json(value: Any) -> str:
    """JSON with sorted keys and no whitespace, so equal configs hash equally."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str)


def fingerprint(kind: str, config: dict[str, Any], input_fingerprints: dict[str, str], code_version: str) -> str:
    payload = canonical_json(
        {"kind": kind, "config": config, "inputs": input_fingerprints, "code_version": code_version}
    )
    return hashlib.sha256(payload.encode()).hexdigest()


def sha256_file(path: str, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()
