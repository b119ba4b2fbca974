"""Ancestry of an artifact, read from manifests alone (back to the raw sources' provenance).

Only the store holding the artifact asked about is read: an input URI that is not one of its artifact folders
(a planted http:// URL, another bucket, a path out through '..') is reported, never opened."""

from __future__ import annotations

from typing import Any

from fsspec.core import url_to_fs

from compass.infra.manifest import MANIFEST, DamagedManifest, InputRef, Manifest, parse_manifest, relocated
from compass.infra.store import checked_manifest


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
            try:
                return where, relocated(parse_manifest(fs.cat_file(f"{candidate}/{MANIFEST}"), where), where)
            except DamagedManifest as exc:
                raise LineageError(str(exc)) from None
        if "/" not in candidate.strip("/"):
            break
        candidate = candidate.rsplit("/", 1)[0]
    raise LineageError(f"no committed artifact (manifest.json) at or above {uri}")


def lineage(uri: str) -> dict[str, Any]:
    """A tree: {step, uri, fingerprint, spec_hash, created, metrics, provenance, inputs: [...]}."""
    where, manifest = find_manifest(uri)
    return _node(manifest, where.rsplit("/", 2)[0], seen={})  # <root>/<kind>/<name>-<fp>


def in_store(uri: str, root: str) -> bool:
    """Whether `uri` names an artifact folder of the store at `root`: <root>/<kind>/<name>-<fp>, nothing else."""
    if not uri.startswith(root.rstrip("/") + "/"):
        return False
    parts = uri[len(root.rstrip("/")) + 1:].split("/")
    return len(parts) == 2 and all(part not in ("", ".", "..") for part in parts)


def _input_manifest(ref: InputRef, root: str) -> Manifest:
    """The committed artifact an input names, read only inside the store at `root`; LineageError otherwise."""
    if not in_store(ref.uri, root):
        raise LineageError(f"{ref.uri} is not an artifact of the store {root}: not followed")
    fs, path = url_to_fs(ref.uri)
    if not fs.exists(f"{path}/{MANIFEST}"):
        raise LineageError(f"no committed artifact at {ref.uri}")
    try:
        return checked_manifest(fs, path, ref.uri)
    except DamagedManifest as exc:
        raise LineageError(str(exc)) from None


def _node(m: Manifest, root: str, seen: dict[str, dict[str, Any]]) -> dict[str, Any]:
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
            parent = _input_manifest(ref, root)
        except LineageError as exc:
            node["inputs"].append({"step": ref.step, "uri": ref.uri, "fingerprint": ref.fingerprint,
                                   "missing": True, "why": str(exc)})
            continue
        if parent.fingerprint != ref.fingerprint:
            node["inputs"].append({"step": ref.step, "uri": ref.uri, "fingerprint": ref.fingerprint,
                                   "mismatch": parent.fingerprint})
            continue
        node["inputs"].append({"role": ref.role, **_node(parent, root, seen)})
    return node
