"""Ancestry of an artifact, read from manifests alone (back to the raw sources' provenance)."""

from __future__ import annotations

from typing import Any

from fsspec.core import url_to_fs

from compass.infra.manifest import MANIFEST, Manifest, relocated


class LineageError(LookupError):
    pass


def find_manifest(uri: str) -> tuple[str, Manifest]:
    """The artifact that holds `uri` (its folder, its manifest, or any file inside it)."""
    uri = uri.rstrip("/")
    if uri.endswith("/" + MANIFEST):
        uri = uri[: -len(MANIFEST) - 1]
    fs, path = url_to_fs(uri)
    protocol = uri.split("://", 1)[0] + "://" if "://" in uri else ""
    candidate = path
    while candidate and candidate not in ("/", "."):
        if fs.exists(f"{candidate}/{MANIFEST}"):
            where = protocol + candidate if protocol else candidate
            with fs.open(f"{candidate}/{MANIFEST}", "r") as f:
                return where, relocated(Manifest.model_validate_json(f.read()), where)
        if "/" not in candidate.strip("/"):
            break
        candidate = candidate.rsplit("/", 1)[0]
    raise LineageError(f"no committed artifact (manifest.json) at or above {uri}")


def lineage(uri: str) -> dict[str, Any]:
    """A tree: {step, uri, fingerprint, spec_hash, created, metrics, provenance, inputs: [...]}."""
    _, manifest = find_manifest(uri)
    return _node(manifest, seen={})


def _node(m: Manifest, seen: dict[str, dict[str, Any]]) -> dict[str, Any]:
    if m.uri in seen:
        return {"step": m.step_id, "uri": m.uri, "fingerprint": m.fingerprint, "see_above": True}
    node: dict[str, Any] = {
        "step": m.step_id, "uri": m.uri, "fingerprint": m.fingerprint, "spec": m.spec_name,
        "spec_hash": m.spec_hash, "code_version": m.code_version, "finished_at": m.finished_at,
        "metrics": {k: v for k, v in m.metrics.items() if not isinstance(v, dict | list)},
        "provenance": m.provenance, "inputs": [],
    }
    seen[m.uri] = node
    for ref in m.inputs:
        try:
            _, parent = find_manifest(ref.uri)
        except LineageError:
            node["inputs"].append({"step": ref.step, "uri": ref.uri, "fingerprint": ref.fingerprint,
                                   "missing": True})
            continue
        if parent.fingerprint != ref.fingerprint:
            node["inputs"].append({"step": ref.step, "uri": ref.uri, "fingerprint": ref.fingerprint,
                                   "mismatch": parent.fingerprint})
            continue
        node["inputs"].append({"role": ref.role, **_node(parent, seen)})
    return node
