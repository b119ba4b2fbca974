"""Would a step run, and why: compares the plan against what the store already holds."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from compass.flows.compiler import Plan
from compass.infra.manifest import DamagedManifest
from compass.infra.store import Store
from compass.tasks.steps.kind import Step


@dataclass(frozen=True)
class StepStatus:
    step_id: str
    uri: str
    state: str     # cached | run | unknown
    reason: str


def _flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(value, dict):
        out: dict[str, Any] = {}
        for k, v in value.items():
            out |= _flatten(v, f"{prefix}.{k}" if prefix else str(k))
        return out if out or not prefix else {prefix: value}
    return {prefix: value}


def changed_fields(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    a, b = _flatten(old), _flatten(new)
    return sorted(k for k in a.keys() | b.keys() if a.get(k, object()) != b.get(k, object()))


def plan_status(plan: Plan, store: Store) -> list[StepStatus]:
    """State and reason per step; when the store cannot be reached, says so instead of failing the plan."""
    try:
        store.fs.exists(store.root_path)
    except Exception as exc:  # credentials, network, endpoint: the plan is still worth printing
        reason = f"store not reachable ({type(exc).__name__})"
        return [StepStatus(s.id, store.uri(s.kind, s.name, plan.fingerprints[s.id]), "unknown", reason)
                for s in plan.steps]
    out: list[StepStatus] = []
    for step in plan.steps:
        uri = store.uri(step.kind, step.name, plan.fingerprints[step.id])
        if store.is_committed(uri):
            damaged = _damaged_manifest(store, uri)
            out.append(StepStatus(step.id, uri, "run", damaged) if damaged else
                       StepStatus(step.id, uri, "cached", "committed"))
            continue
        out.append(StepStatus(step.id, uri, "run", _why_run(plan, step, store)))
    return out


def _damaged_manifest(store: Store, uri: str) -> str | None:
    """Why a committed artifact's manifest cannot be used (the run sets the artifact aside and recomputes it, or
    stops with `on_damage: stop`), or None when it reads."""
    try:
        store.read_manifest(uri)
    except DamagedManifest as exc:
        return f"damaged manifest, set aside when run: {str(exc).removeprefix(uri + '/')}"
    return None


def _why_run(plan: Plan, step: Step, store: Store) -> str:
    previous = store.committed(step.kind, step.name)
    if not previous:
        return "new"
    last = previous[0]
    fields = changed_fields(last.config, step.config.identity())
    if fields:
        shown = ", ".join(fields[:6]) + (f" (+{len(fields) - 6} more)" if len(fields) > 6 else "")
        return f"config changed: {shown}"
    old_inputs = {ref.role: ref.fingerprint for ref in last.inputs}
    changed = [dep for role, dep in step.inputs.items() if old_inputs.get(role) != plan.fingerprints[dep]]
    if changed:
        return f"input changed: {', '.join(changed)}"
    return "code version changed"
