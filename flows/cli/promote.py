"""`compass ablate promote`: write a new spec whose baseline includes a winning ablation change (the
playbook's loop: integrate what helped, then test the next change against the new baseline)."""

from __future__ import annotations

import difflib
import io
from pathlib import Path

from ruamel.yaml import YAML

from compass.flows.validation import CheckedSpec, load_checked
from compass.infra.layout import COMPARISON
from compass.infra.store import Store
from compass.tasks.common.comparison import Comparison


class PromoteError(ValueError):
    pass


def winning_variant(checked: CheckedSpec, store: Store) -> str:
    """The variant the committed comparison of this spec judged best ('better' with the largest gain)."""
    plan = checked.plan
    if "compare:ablations" not in plan.fingerprints:
        raise PromoteError("the spec has no ablations")
    uri = store.uri("compare", "ablations", plan.fingerprints["compare:ablations"])
    if not store.is_committed(uri):
        raise PromoteError(f"no comparison at {uri}: run the spec first (compass run), or name --variant")
    return winner(Comparison.model_validate_json(store.read_bytes(uri, COMPARISON)))


def winner(comparison: Comparison) -> str:
    """The variant a comparison judged best: 'better' (beyond the seed noise) with the largest gain in the
    metric's good direction; PromoteError when none is better."""
    better = comparison.better()
    if not better:
        verdicts = ", ".join(f"{r.variant}: {r.verdict}" for r in comparison.rows[1:])
        raise PromoteError(f"no variant beat the baseline beyond the seed noise ({verdicts}); nothing to promote")
    gain = -1 if comparison.direction() == "lower" else 1
    return max(better, key=lambda r: gain * r.delta).variant


LAYOUTS = ((2, 4, 2), (2, 2, 0), (4, 4, 0), (4, 6, 2), (4, 4, 2), (3, 3, 0))  # mapping, sequence, dash offset


def _layout_of(text: str) -> YAML:
    """A round-trip YAML that writes the file back as it is (its indentation, quotes and long lines kept), so a
    promotion changes only what it changes; the first candidate layout that reproduces the most lines."""
    def configured(mapping: int, sequence: int, offset: int) -> YAML:
        yaml = YAML(typ="rt")
        yaml.indent(mapping=mapping, sequence=sequence, offset=offset)
        yaml.width = 1 << 16  # no line is folded
        yaml.preserve_quotes = True
        return yaml

    def kept(yaml: YAML) -> int:
        buffer = io.StringIO()
        yaml.dump(yaml.load(text), buffer)
        return len(set(buffer.getvalue().splitlines()) & set(text.splitlines()))

    return max((configured(*layout) for layout in LAYOUTS), key=kept)


def _unfolded(original: str, written: str) -> str:
    """`written` with each stretch that differs from `original` only in where its lines break (a flow mapping or
    list the file wraps over lines, which YAML writes on one) taken back from `original`."""

    before, after = original.splitlines(keepends=True), written.splitlines(keepends=True)
    merged: list[str] = []
    for op, i1, i2, j1, j2 in difflib.SequenceMatcher(None, before, after, autojunk=False).get_opcodes():
        same = op == "replace" and "".join(before[i1:i2]).split() == "".join(after[j1:j2]).split()
        merged += before[i1:i2] if op == "equal" or same else after[j1:j2]
    return "".join(merged)


def promote(spec_path: Path, variant: str, out: Path) -> str:
    """Apply the variant's change to the spec (architecture changes to what.architecture, the rest to the
    ablation baseline), drop the variant, write `out` and validate it. Returns the change applied."""
    text = spec_path.read_text()
    yaml = _layout_of(text)
    data = yaml.load(text)
    ablations = data["what"].get("ablations")
    variants = ablations["variants"] if ablations else []
    match = [v for v in variants if v["name"] == variant]
    if not match:
        raise PromoteError(f"no variant '{variant}' in {spec_path} (have: {', '.join(v['name'] for v in variants)})")
    (path, value), = match[0]["change"].items()
    if path.startswith("architecture."):
        target, keys = data["what"]["architecture"], path.split(".")[1:]
    else:
        target, keys = ablations["baseline"], path.split(".")
    for key in keys[:-1]:
        target = target[key]
    target[keys[-1]] = value
    variants.remove(match[0])
    if not variants:
        del data["what"]["ablations"]
    buffer = io.StringIO()
    yaml.dump(data, buffer)
    out.write_text(_unfolded(text, buffer.getvalue()))
    load_checked(out)  # the promoted spec must be valid (raises SpecError with locations otherwise)
    return f"{path} = {value!r}"
