"""`compass ablate promote`: write a new spec whose baseline includes a winning ablation change (the
playbook's loop: integrate what helped, then test the next change against the new baseline)."""

from __future__ import annotations

import difflib
import io
from pathlib import Path
from typing import Any

from ruamel.yaml import YAML

from compass.flows.cli.yaml_splice import block_end, flow_text, replaced
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
    ablation baseline), drop the variant, write `out` and validate it. Returns the change applied. The file is
    edited in its text (flows/cli/yaml_splice.py): the promoted value where it is written, the variant's lines (or
    the ablations section, its last variant gone) cut out, nothing else touched; a change the text cannot take in
    place (a key to add, a value written over several lines) goes through a round trip that keeps the layout."""
    text = spec_path.read_text()
    data = YAML(typ="rt").load(text)
    ablations = data["what"].get("ablations")
    variants = ablations["variants"] if ablations else []
    match = [v for v in variants if v["name"] == variant]
    if not match:
        raise PromoteError(f"no variant '{variant}' in {spec_path} (have: {', '.join(v['name'] for v in variants)})")
    (path, value), = match[0]["change"].items()
    edited = _in_place(text, data, variants.index(match[0]), path, value)
    out.write_text(edited if edited is not None else _round_trip(text, variant, path, value))
    load_checked(out)  # the promoted spec must be valid (raises SpecError with locations otherwise)
    return f"{path} = {value!r}"


def _target(data: Any, path: str) -> tuple[Any, str]:
    """The mapping the change's last key is in, and that key."""
    if path.startswith("architecture."):
        target, keys = data["what"]["architecture"], path.split(".")[1:]
    else:
        target, keys = data["what"]["ablations"]["baseline"], path.split(".")
    for key in keys[:-1]:
        target = target[key]
    return target, keys[-1]


def _in_place(text: str, data: Any, index: int, path: str, value: Any) -> str | None:
    """The promotion as a text edit of `text` (parsed as `data`), or None where it cannot be one."""
    lines = text.splitlines(keepends=True)
    what = data["what"]
    variants = what["ablations"]["variants"]
    if getattr(variants, "fa", None) is None or variants.fa.flow_style():
        return None
    try:
        target, key = _target(data, path)
    except (KeyError, TypeError):
        return None
    if not hasattr(target, "lc") or (key not in target and (target.fa.flow_style() or not target)):
        return None  # a key to add inside braces, or to a mapping with none yet
    old = target.get(key)
    if hasattr(old, "fa") and not old.fa.flow_style():
        return None  # a value written as a block over several lines
    if len(variants) == 1:  # the last variant: the whole section goes
        first, indent = what.lc.key("ablations")
    else:
        item, content = variants.lc.item(index)
        indent = lines[item].rfind("-", 0, content)
        first = item
        while first > 0 and lines[first - 1].lstrip().startswith("#") and \
                len(lines[first - 1]) - len(lines[first - 1].lstrip()) == indent:
            first -= 1  # the comment lines written above the variant are its own
    cut = range(first, block_end(lines, item if len(variants) > 1 else first, indent))
    added: tuple[int, str] | None = None
    if key not in target:  # a new line after the mapping's last entry, at its keys' indentation
        last_line, last_col = target.lc.key(list(target)[-1])
        added = (block_end(lines, last_line, last_col), f"{' ' * last_col}{key}: {flow_text(value)}\n")
    else:
        line, col = target.lc.value(key)
        if line not in cut:
            try:
                lines[line] = replaced(lines[line], col, target.fa.flow_style(), flow_text(value))
            except ValueError:
                return None
    kept = lines[:cut.start] + lines[cut.stop:]
    if added is not None and added[0] not in cut:
        at, new_line = added
        kept.insert(at if at < cut.start else at - len(cut), new_line)
    at = cut.start
    if 0 < at < len(kept) and not kept[at - 1].strip() and not kept[at].strip():
        del kept[at]  # the blank lines around a cut section: one of them
    return "".join(kept)


def _round_trip(text: str, variant: str, path: str, value: Any) -> str:
    """The promotion through a load and dump in the file's own layout (the lines it cannot keep re-joined)."""
    yaml = _layout_of(text)
    data = yaml.load(text)
    ablations = data["what"]["ablations"]
    variants = ablations["variants"]
    target, key = _target(data, path)
    target[key] = value
    variants.remove(next(v for v in variants if v["name"] == variant))
    if not variants:
        del data["what"]["ablations"]
    buffer = io.StringIO()
    yaml.dump(data, buffer)
    return _unfolded(text, buffer.getvalue())
