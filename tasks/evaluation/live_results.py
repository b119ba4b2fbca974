"""Where the evaluations outside a run (compass deploy's per-checkpoint evaluation, the scheduled one) keep their
scores, and how a run's own evaluate step finds one to take instead of scoring the same weights again.

A result is keyed by the suite (the hash of its benchmarks and the evaluate kind's version) and by the sha256 of the
checkpoint's weights: the same weights under the same suite score the same, so the evaluate step that later reaches
a checkpoint a live evaluation scored while its stage trained takes those benchmark scores (computed on the same
device and precision) and computes only what the live evaluation does not (held-out perplexity, passkey).
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from compass.infra.fingerprint import canonical_json
from compass.infra.store import Store
from compass.specs.evaluation import Benchmark
from compass.tasks.common.devices import Device

EVALUATIONS = ".evaluations"  # under the store's root: <suite[:12]>/<weights sha256[:20]>.json


def suite_hash(benchmarks: list[dict[str, Any]], version: str) -> str:
    """The suite's identity: its benchmarks as JSON and the evaluate kind's version (how it scores)."""
    return hashlib.sha256(canonical_json({"benchmarks": benchmarks, "version": version}).encode()).hexdigest()


def result_path(store: Store, suite: str, weights_sha256: str) -> str:
    return f"{store.root_path}/{EVALUATIONS}/{suite[:12]}/{weights_sha256[:20]}.json"


def live_scores(store: Store, benchmarks: list[Benchmark], version: str, weights_sha256: str,
                where: Device | None) -> dict[str, float] | None:
    """The benchmark scores an evaluation outside the run wrote for these weights under this suite, on the device
    and precision `where` names (None: none, or one computed elsewhere or on other weights)."""
    suite = suite_hash([b.model_dump(mode="json") for b in benchmarks], version)
    path = result_path(store, suite, weights_sha256)
    if not store.fs.exists(path):
        return None
    with store.fs.open(path) as f:
        record = json.load(f)
    same_place = (record.get("device"), record.get("dtype")) == ((where.device, where.dtype) if where else
                                                                 ("cpu", "float32"))
    same_weights = (record.get("checkpoint") or {}).get("weights_sha256") == weights_sha256
    if not (same_place and same_weights and record.get("suite") == suite):
        return None
    return {k: float(v) for k, v in record["metrics"].items()}
