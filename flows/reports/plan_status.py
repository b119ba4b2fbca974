"""Would a step run, and why: compares the plan against what the store already holds, field by field (the spec's
config slice, the `how` fields in the step's identity, its inputs, its kind's code version), and for a reused
artifact, the placement it was made under where that differs from the spec's now."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from compass.flows.compiler import Plan
from compass.infra import verify
from compass.infra.manifest import DamagedManifest, Manifest
from compass.infra.store import Store
from compass.specs.how_identity import identity_of
from compass.specs.input_stamps import LEGACY_STAMPS, stamped_field
from compass.tasks.steps import registry
from compass.tasks.steps.kind import Step

MOST_SHOWN = 6  # changed fields named in one reason


@dataclass(frozen=True)
class StepStatus:
    step_id: str
    uri: str
    state: str     # cached | run | unknown
    reason: str
    changed_inputs: tuple[str, ...] = ()  # the inputs (step ids) whose artifacts differ from the last commit's


def _flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    """Leaves by path (`stages[0].tokens`); an empty dict or list is a leaf of its own."""
    if isinstance(value, dict | list) and value:
        items = value.items() if isinstance(value, dict) else ((f"[{i}]", v) for i, v in enumerate(value))
        out: dict[str, Any] = {}
        for k, v in items:
            out |= _flatten(v, f"{prefix}{k}" if str(k).startswith("[") else f"{prefix}.{k}" if prefix else str(k))
        return out
    return {prefix: value}


_ABSENT = object()


def changed_fields(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    a, b = _flatten(old), _flatten(new)
    return sorted(k for k in a.keys() | b.keys() if a.get(k, _ABSENT) != b.get(k, _ABSENT))


def _shown(value: Any) -> str:
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    text = "unset" if value is _ABSENT else "null" if value is None else str(value)
    return text if len(text) <= 40 else text[:37] + "..."


def changes(old: dict[str, Any], new: dict[str, Any], prefix: str = "") -> str:
    """`stage.tokens 20000 -> 40000, lr 0.001 -> 0.002`: each changed leaf with its old and new value."""
    a, b = _flatten(old), _flatten(new)
    fields = changed_fields(old, new)
    shown = [f"{prefix}{f} {_shown(a.get(f, _ABSENT))} -> {_shown(b.get(f, _ABSENT))}" for f in fields[:MOST_SHOWN]]
    more = f" (+{len(fields) - MOST_SHOWN} more)" if len(fields) > MOST_SHOWN else ""
    return ", ".join(shown) + more


def split_stamps(config: dict[str, Any]) -> tuple[dict[str, Any], dict[str, tuple[str, Any]]]:
    """The config without its file stamps, and the stamps by the field they stamp (`dataset`,
    `candidates[1].path`; a source's listing as `source files`): (what the field names, the stamp)."""
    stamps: dict[str, tuple[str, Any]] = {}

    def strip(value: Any, prefix: str) -> Any:
        if isinstance(value, list):
            return [strip(v, f"{prefix}[{i}]") for i, v in enumerate(value)]
        if not isinstance(value, dict):
            return value
        kept = {}
        for key, inner in value.items():
            named = stamped_field(key)
            if named is None:
                kept[key] = strip(inner, f"{prefix}.{key}" if prefix else key)
            elif inner is not None:
                label = "source files" if key in LEGACY_STAMPS else f"{prefix}.{named}" if prefix else named
                stamps[label] = (str(value.get(named)), inner)
        return kept

    return strip(config, ""), stamps


def plan_status(plan: Plan, store: Store, depth: verify.Depth | None = None) -> list[StepStatus]:
    """State and reason per step; when the store cannot be reached, says so instead of failing the plan. A cached
    artifact is checked against its manifest at `depth` (default: how.storage.verify, as the run checks it)."""
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
            try:
                manifest = store.read_manifest(uri)
            except DamagedManifest as exc:
                why = f"damaged manifest, set aside when run: {str(exc).removeprefix(uri + '/')}"
                out.append(StepStatus(step.id, uri, "run", why))
                continue
            damaged = verify.damage(store, uri, depth or plan.how.storage.verify,  # as the run checks it
                                    expects=plan.fingerprints[step.id])
            if damaged:
                then = ("set aside and run again" if plan.how.storage.on_damage == "recompute" else
                        "the run stops there (how.storage.on_damage: stop)")
                out.append(StepStatus(step.id, uri, "run", f"altered after its commit ({verify.describe(damaged)}): "
                                      f"{then}"))
                continue
            made = made_under(plan, step, manifest)
            out.append(StepStatus(step.id, uri, "cached", "committed" + (f"; made under {made}" if made else "")))
            continue
        reason, changed = why_run(plan, step, store)
        out.append(StepStatus(step.id, uri, "run", reason, changed))
    return out


def _placement_now(plan: Plan, step: Step) -> dict[str, Any]:
    """The placement-side values a step would run under now: its `how` numerics and its job's shape."""
    kind = registry.kind(step.kind)
    values = {p: v for p, v in kind.how_read(step.config, plan.how).items() if identity_of(p) != "results"}
    if kind.resources is not None:
        shape = kind.resources(step.config, plan.how)
        values |= {"nodes": shape.nodes, "devices_per_node": shape.devices_per_node}
    return values


def _placement_then(manifest: Manifest) -> dict[str, Any]:
    values = {p: v for p, v in manifest.how.items() if identity_of(p) != "results"}
    if manifest.execution is not None and manifest.execution.devices_per_node:
        values |= {"nodes": manifest.execution.nodes, "devices_per_node": manifest.execution.devices_per_node}
    return values


def made_under(plan: Plan, step: Step, manifest: Manifest) -> str:
    """For a reused artifact made under another placement (ranks, ZeRO stage, accelerator): what it was, and what
    it is now (`parallelism.zero_stage 2 (now 0)`); empty when the placement is the same or was not recorded."""
    then, now = _placement_then(manifest), _placement_now(plan, step)
    differing = [k for k in then if k in now and then[k] != now[k]]
    return ", ".join(f"{k} {_shown(then[k])} (now {_shown(now[k])})" for k in differing)


def why_run(plan: Plan, step: Step, store: Store) -> tuple[str, tuple[str, ...]]:
    """Why a step has no committed artifact: new, or what differs from its newest committed one; and which of its
    inputs differ."""
    previous = store.committed(step.kind, step.name)
    if not previous:
        return "new", ()
    last = previous[0]
    kind = registry.kind(step.kind)
    reasons = []
    (old_config, old_files), (new_config, new_files) = split_stamps(last.config), split_stamps(step.config.identity())
    for field in sorted(old_files.keys() | new_files.keys()):
        if old_files.get(field) != new_files.get(field):
            named = (new_files.get(field) or old_files[field])[0]
            reasons.append(f"{field} changed: {named}" if field in old_files else
                           f"{field} {named}: made before its files entered its identity")
    if changed_fields(old_config, new_config):
        reasons.append("config changed: " + changes(old_config, new_config))
    then = {p: v for p, v in last.how.items() if identity_of(p) == "results"}
    now = kind.how_identity(step.config, plan.how)
    if then != now:
        reasons.append("how changed: " + changes(then, now, "how.") if then else
                       "made before its how fields entered its identity")
    old_inputs = {ref.role: ref.fingerprint for ref in last.inputs}
    changed = [dep for role, dep in step.inputs.items() if old_inputs.get(role) != plan.fingerprints[dep]]
    if changed:
        reasons.append(f"input changed: {', '.join(changed)}")
    if reasons:
        return "; ".join(reasons), tuple(changed)
    if last.phase_version != kind.version:
        return f"code version changed ({last.phase_version} -> {kind.version})", ()
    return "code version changed", ()
