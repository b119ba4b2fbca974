"""Load a YAML spec and report every problem as `file:line: field.path: what is wrong (hint)`."""

from __future__ import annotations

import copy
import difflib
import hashlib
import stat
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from functools import cache
from pathlib import Path
from typing import Any, get_args

from pydantic import BaseModel, ValidationError
from ruamel.yaml.comments import CommentedMap, CommentedSeq, merge_attrib
from ruamel.yaml.constructor import ConstructorError
from ruamel.yaml.error import MarkedYAMLError, YAMLError

from compass.specs import yaml_limits
from compass.specs.base import Issue, Loc
from compass.specs.checkpoint_config import resolve_named_models, resolve_starting_model
from compass.specs.checks import check_spec
from compass.specs.how import SLURM_WORD
from compass.specs.input_stamps import resolve_input_stamps
from compass.specs.spec import TrainingSpec


@dataclass(frozen=True)
class SpecProblem:
    """One thing wrong with a spec, located in the file."""

    file: str
    line: int
    path: str
    message: str
    hint: str = ""

    def __str__(self) -> str:
        hint = f" ({self.hint})" if self.hint else ""
        where = self.path or "<spec>"
        return f"{self.file}:{self.line}: {where}: {self.message}{hint}"


class SpecError(Exception):
    """Every problem found in a spec file; the CLI prints them all and exits with code 2. `partial`: the spec with
    what was refused left out, for the checks of a later phase that can still run on the rest (one pass finds
    every problem, not the first phase's)."""

    def __init__(self, problems: list[SpecProblem], partial: LoadedSpec | None = None):
        self.problems = problems
        self.partial = partial
        super().__init__("\n".join(str(p) for p in problems))


@dataclass(frozen=True)
class LoadedSpec:
    """A validated spec with where it came from (relative paths resolve against `base_dir`), and the map from
    its fields to lines, so that checks made later (machine checks, plan) still point at the line to fix."""

    spec: TrainingSpec
    path: str
    base_dir: Path
    text: str
    lines: _LineIndex = field(repr=False, compare=False)
    data: Any = field(repr=False, compare=False)
    size: str = "full"  # "smoke" or "rehearsal" when the spec was shrunk (compass.specs.smoke.Size)
    size_changes: tuple[Any, ...] = ()  # what shrinking it changed (compass.specs.smoke.Shrink)
    # a partial spec's fields the schema refused, each in its default's place (SpecError.partial): what a later
    # check says of their sections comes of the defaults, and is left out
    defaulted: tuple[Loc, ...] = ()

    @property
    def spec_hash(self) -> str:
        return spec_hash(self.spec)

    def problems(self, issues: Iterable[Issue]) -> list[SpecProblem]:
        """The issues as located problems, in file order (of a partial spec, those its defaults did not cause)."""
        return sorted((SpecProblem(self.path, self.lines.line_for(_data_loc(i.loc, self.data)), _dotted(i.loc),
                                   i.message, i.hint) for i in issues if not _of_defaults(i.loc, self.defaulted)),
                      key=lambda p: p.line)


def spec_hash(spec: TrainingSpec) -> str:
    """Hash of the validated spec's canonical JSON (formatting and comments do not change it)."""
    return hashlib.sha256(spec.model_dump_json().encode()).hexdigest()


def load_spec(path: str | Path) -> LoadedSpec:
    p = Path(path)
    try:
        text = _bounded_text(p)
    except FileNotFoundError:
        raise SpecError([SpecProblem(str(path), 1, "", "file not found", "check the path")]) from None
    except (IsADirectoryError, UnicodeDecodeError) as exc:
        raise SpecError([SpecProblem(str(path), 1, "", f"cannot read: {exc}", "give a UTF-8 YAML file")]) from None
    return load_spec_text(text, str(path), base_dir=p.resolve().parent)


def _bounded_text(p: Path) -> str:
    """The spec file's text, read no further than the size limit allows: a regular file only (a device such as
    /dev/zero reads forever, a FIFO blocks), its size as read, not as stat says."""
    if p.is_dir():
        raise IsADirectoryError(str(p))
    if not stat.S_ISREG(p.stat().st_mode):
        raise SpecError([SpecProblem(str(p), 1, "<spec>", "not a regular file (a device, a FIFO or a socket)",
                                     "give the spec's YAML file")])
    limit = yaml_limits.max_bytes()
    with open(p, "rb") as f:
        body = f.read(limit + 1)
    too_big = yaml_limits.size_problem(max(len(body), p.stat().st_size) if len(body) > limit else len(body))
    if too_big:
        raise SpecError([SpecProblem(str(p), 1, "<spec>", too_big.message, too_big.hint)])
    return body.decode("utf-8")


def load_spec_text(text: str, filename: str = "<spec>", base_dir: Path | None = None) -> LoadedSpec:
    """Parse, resolve what the spec names outside itself, then run the cross-field checks; raise SpecError with
    all problems. A spec the schema refuses goes on to the later phases with the refused fields left out, so that
    one run reports a field's, a path's and a benchmark's problem together (the error carries it as `partial`)."""
    problems: list[SpecProblem] = []
    try:
        loaded = parse_spec_text(text, filename, base_dir)
    except SpecError as exc:
        if exc.partial is None:
            raise
        problems, loaded = list(exc.problems), exc.partial
    try:
        loaded = check_loaded(resolve_facts(loaded))
    except SpecError as exc:
        problems += exc.problems
    if problems:
        raise SpecError(merged_problems(problems), partial=loaded)
    return loaded


def merged_problems(problems: Iterable[SpecProblem]) -> list[SpecProblem]:
    """Problems found by several phases, each once, in file order."""
    return sorted(dict.fromkeys(problems), key=lambda p: p.line)


def parse_spec_text(text: str, filename: str = "<spec>", base_dir: Path | None = None) -> LoadedSpec:
    """The YAML parsed and validated against the schema, and nothing else: no file, hub, network or machine is
    read (tests/test_wiring_check_once.py), so a spec's shape can be judged anywhere."""
    base = base_dir or Path.cwd()
    data = _parse_yaml(text, filename)
    lines = _LineIndex(data)
    plain = _to_plain(data)
    try:
        spec = TrainingSpec.model_validate(plain, context=_context(base))
    except ValidationError as exc:
        repaired = _repaired(plain, exc, base)
        partial = None if repaired is None else LoadedSpec(spec=repaired[0], path=filename, base_dir=base, text=text,
                                                           lines=lines, data=plain, defaulted=repaired[1])
        raise SpecError(_problems_from_validation(exc, plain, lines, filename), partial) from None
    return LoadedSpec(spec=spec, path=filename, base_dir=base, text=text, lines=lines, data=plain)


REPAIR_ROUNDS = 10  # a refused field left out can reveal another (a missing one above it): a few rounds at most

# the sections a rule reads besides its own: a criterion names what the evaluation, the long-context stages and the
# sources produce, so with one of them defaulted what it says of a criterion is not to be trusted
READS_ALSO: dict[Loc, tuple[Loc, ...]] = {
    ("why", "success_criteria"): (("what", "evaluation"), ("what", "long_context"), ("what", "data")),
}


def _context(base: Path) -> dict[str, Any]:
    """What the schema's validators know of where the spec is: its folder, where its relative paths start."""
    return {"base_dir": base}


def _repaired(plain: Any, exc: ValidationError, base: Path) -> tuple[TrainingSpec, tuple[Loc, ...]] | None:
    """The spec with each field the schema refused left out (its default in its place; a field that has none, the
    nearest mapping above it), and those fields; None when that leaves nothing the schema accepts."""
    data = copy.deepcopy(plain)
    defaulted: list[Loc] = []
    removed: list[Loc] = []
    for _ in range(REPAIR_ROUNDS):
        for err in exc.errors(include_url=False):
            loc = _data_loc(tuple(err["loc"]), data)
            if any(loc[:len(r)] == r for r in removed):
                continue  # inside what an error before it left out
            target = loc[:-1] if err["type"] == "missing" else loc
            while target and not _is_key(data, target):
                target = target[:-1]
            if not target:
                return None
            _node(data, target[:-1]).pop(target[-1])
            removed.append(target)
            if err["type"] != "extra_forbidden":  # an unknown key means nothing: leaving it out defaults nothing
                defaulted.append(target)
        try:
            return TrainingSpec.model_validate(data, context=_context(base)), tuple(defaulted)
        except ValidationError as again:
            exc = again
    return None


def _node(data: Any, path: Loc) -> Any:
    """The value at a data path (None where there is none)."""
    for part in path:
        in_mapping = isinstance(data, dict) and isinstance(part, str) and part in data
        in_list = isinstance(data, list) and isinstance(part, int) and 0 <= part < len(data)
        if not (in_mapping or in_list):
            return None
        data = data[part]
    return data


def _is_key(data: Any, path: Loc) -> bool:
    parent = _node(data, path[:-1])
    return isinstance(path[-1], str) and isinstance(parent, dict) and path[-1] in parent


def _of_defaults(loc: Loc, defaulted: tuple[Loc, ...]) -> bool:
    """Whether a problem at `loc` may come of a defaulted field: it lies in that field's section, or its rule
    reads that section (READS_ALSO)."""
    sections = {d[:2] for d in defaulted}
    read = {s for reader, also in READS_ALSO.items() if loc[:len(reader)] == reader for s in also}
    return any(loc[:len(s)] == s for s in sections) or any(s[:len(r)] == r or r[:len(s)] == s
                                                              for s in sections for r in read)


def resolve_facts(loaded: LoadedSpec) -> LoadedSpec:
    """The loader's only reads of the world, each a fact that enters step identity: the starting checkpoint's and
    the named models' configs and stamps (what.model, what.models), and the stamp of every file the spec names
    (specs/input_stamps.py: sources, post-training datasets, tokenizers).
    Machine checks (hardware, the cluster, the shared root) are made once per run, apart (flows/validation.py)."""
    spec, issues = resolve_starting_model(loaded.spec, loaded.base_dir)
    if not issues:
        spec, issues = resolve_named_models(spec, loaded.base_dir)
    if not issues:
        spec, issues = resolve_input_stamps(spec, loaded.base_dir)
    if issues:
        raise SpecError(loaded.problems(issues))
    return replace(loaded, spec=spec)


def check_loaded(loaded: LoadedSpec) -> LoadedSpec:
    """The cross-field rules (specs/checks.py and each section's own), on the resolved spec; pure."""

    issues = check_spec(loaded.spec)
    if issues:
        raise SpecError(loaded.problems(issues))
    return loaded


def _parse_yaml(text: str, filename: str) -> Any:
    problem = yaml_limits.size_problem(len(text.encode("utf-8", errors="replace")))
    if problem:
        raise SpecError([SpecProblem(filename, problem.line + 1, "<yaml>", problem.message, problem.hint)])
    try:
        data = yaml_limits.load(text)
    except yaml_limits.LimitError as exc:
        limit = exc.problem
        raise SpecError([SpecProblem(filename, limit.line + 1, "<yaml>", limit.message, limit.hint)]) from None
    except MarkedYAMLError as exc:
        raise SpecError([_yaml_problem(exc, filename)]) from None
    except YAMLError as exc:
        raise SpecError([SpecProblem(filename, 1, "<yaml>", str(exc), "check the YAML syntax")]) from None
    if not isinstance(data, CommentedMap):
        line = data.lc.line + 1 if hasattr(data, "lc") else 1
        raise SpecError([SpecProblem(filename, line, "<spec>", "the spec must be a mapping with why, what, how",
                                     "start from specs/examples/tiny.yaml")])
    return data


def _yaml_problem(exc: MarkedYAMLError, filename: str) -> SpecProblem:
    mark = exc.problem_mark or exc.context_mark
    line = mark.line + 1 if mark else 1
    problem = exc.problem or exc.context or "invalid YAML"
    if "duplicate" in str(exc):
        hint = "duplicate keys are not allowed"
    elif isinstance(exc, ConstructorError):
        hint = "fix the value, or quote it to keep it text"
    else:
        hint = "check indentation and quoting"
    return SpecProblem(filename, line, "<yaml>", problem, hint)


class _LineIndex:
    """Maps a data path (keys and list indexes) to the 1-based line where it appears."""

    def __init__(self, root: Any):
        self._lines: dict[Loc, int] = {(): root.lc.line + 1 if hasattr(root, "lc") else 1}
        self._walk(root, ())

    def _walk(self, node: Any, loc: Loc) -> None:
        if isinstance(node, CommentedMap):
            for key, value in node.items():
                self._lines[(*loc, str(key))] = _key_line(node, key) + 1
                self._walk(value, (*loc, str(key)))
        elif isinstance(node, CommentedSeq):
            for i, value in enumerate(node):
                line, _ = node.lc.item(i)
                self._lines[(*loc, i)] = line + 1
                self._walk(value, (*loc, i))

    def line_for(self, loc: Loc) -> int:
        while loc not in self._lines:
            loc = loc[:-1]
        return self._lines[loc]


def _key_line(node: CommentedMap, key: Any) -> int:
    """0-based line of a key; a key a merge (`<<: *anchor`) brought in is on the line of the mapping it came from."""
    if key in (node.lc.data or {}):  # a mapping holding nothing but a merge has no key positions of its own
        return node.lc.key(key)[0]
    for merged in getattr(node, merge_attrib, []):
        source = merged[1] if isinstance(merged, tuple) else merged  # ruamel keeps (position, mapping) pairs
        if isinstance(source, CommentedMap) and key in source:
            return _key_line(source, key)
    return node.lc.line


def _to_plain(node: Any) -> Any:
    if isinstance(node, dict):
        return {str(k): _to_plain(v) for k, v in node.items()}
    if isinstance(node, list):
        return [_to_plain(v) for v in node]
    return node


def _data_loc(loc: Loc, data: Any) -> Loc:
    """Drop the parts of a pydantic location that are not in the data (union tags, function names)."""
    out: list[str | int] = []
    node = data
    for part in loc:
        if isinstance(node, dict) and str(part) in node:
            node = node[str(part)]
            out.append(str(part))
        elif isinstance(node, list) and isinstance(part, int) and 0 <= part < len(node):
            node = node[part]
            out.append(part)
        elif isinstance(node, dict) and isinstance(part, str) and not _is_tag(part):
            out.append(part)  # a missing or extra key: keep it so the message names it
            node = None
        # else: a union tag or validator name pydantic inserts; skip it
    return tuple(out)


def _is_tag(part: str) -> bool:
    return part.startswith("function-") or "[" in part or part in _union_tags()


@cache
def _union_tags() -> frozenset[str]:
    """Discriminator values pydantic puts into error locations (e.g. 'research', 'sft', 'bpe')."""
    tags: set[str] = set()

    def visit(node: Any) -> None:
        if isinstance(node, dict):
            tags.update(node.get("discriminator", {}).get("mapping", {}))
            for value in node.values():
                visit(value)
        elif isinstance(node, list):
            for value in node:
                visit(value)

    visit(TrainingSpec.model_json_schema())
    return frozenset(tags)


@cache
def _all_field_names() -> frozenset[str]:
    names: set[str] = set()

    def visit(model: type[BaseModel]) -> None:
        for name, info in model.model_fields.items():
            if name in names:
                continue
            names.add(name)
            for sub in _models_in(info.annotation):
                visit(sub)

    visit(TrainingSpec)
    return frozenset(names)


# names people bring from other tools, and the field they mean here
ALIASES = {"tasks": "benchmarks", "datasets": "sources", "lr_schedule": "schedule", "dtype": "precision",
           "gradient_checkpointing": "activation_checkpointing", "batch_size": "global_batch_size",
           "seq_len": "sequence_length", "max_seq_length": "sequence_length", "vocab": "vocab_size"}


def _section_fields(loc: tuple[Any, ...]) -> frozenset[str]:
    """The fields of the section that holds loc's last key: every model the schema allows there (a union's
    members, a list's or mapping's items)."""
    models: list[type[BaseModel]] = [TrainingSpec]
    for key in loc[:-1]:
        inner = [sub for m in models if isinstance(key, str) and key in m.model_fields
                 for sub in _models_in(m.model_fields[key].annotation)]
        models = inner or models  # a list index or a mapping's key: the same items
    return frozenset(name for m in models for name in m.model_fields)


def _unknown_field_hint(key: str, section: frozenset[str]) -> str:
    """A suggestion from the section's own fields (or the alias table); a field of another section said so."""
    if ALIASES.get(key) in section:
        return f"did you mean '{ALIASES[key]}'?"
    close = difflib.get_close_matches(key, sorted(section - {key}), n=1, cutoff=0.6)
    if close:
        return f"did you mean '{close[0]}'?"
    if key in _all_field_names():
        return "it belongs to other sections, not this one: remove it (`compass schema` lists the fields)"
    return "remove it; `compass schema` lists the fields"


def _models_in(annotation: Any) -> list[type[BaseModel]]:

    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in get_args(annotation) for m in _models_in(arg)]


def _dotted(loc: Loc) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


_HINTS = {
    "missing": "add this field",
    "literal_error": "use one of the listed values",
    "enum": "use one of the listed values",
    "int_parsing": "write a whole number",
    "int_from_float": "write a whole number",
    "float_parsing": "write a number such as 2e-4",
    "finite_number": "write a finite number: .inf and .nan are not allowed",
    "bool_parsing": "write true or false",
    "greater_than": "use a larger value",
    "greater_than_equal": "use a larger value",
    "less_than": "use a smaller value",
    "less_than_equal": "use a smaller value",
    "string_pattern_mismatch": "use lower_snake_case: letters, digits and underscores, starting with a letter",
    "too_short": "add at least one entry",
    "dict_type": "write a mapping (key: value lines)",
    "list_type": "write a list (lines starting with '- ')",
    "model_type": "write a mapping (key: value lines)",
    "model_attributes_type": "write a mapping (key: value lines)",
}


def _problems_from_validation(exc: ValidationError, data: Any, lines: _LineIndex, filename: str) -> list[SpecProblem]:
    problems = []
    for err in exc.errors(include_url=False):
        loc = _data_loc(tuple(err["loc"]), data)
        kind = err["type"]
        message = err["msg"]
        hint = _HINTS.get(kind, "")
        if kind == "extra_forbidden":
            key = str(loc[-1]) if loc else ""
            message = f"unknown field '{key}'"
            hint = _unknown_field_hint(key, _section_fields(loc))
        elif kind == "string_pattern_mismatch" and err.get("ctx", {}).get("pattern") == SLURM_WORD:
            hint = "one word: letters, digits and ._-:@%+=[], without spaces or newlines, not starting with '-'"
        elif kind == "missing" and loc:
            parent = _dotted(loc[:-1]) or "the top level"
            hint = f"add '{loc[-1]}:' under {parent}"
        elif kind in ("union_tag_invalid", "union_tag_not_found"):
            tag = str(err.get("ctx", {}).get("discriminator", "")).strip("'\"")
            loc = (*loc, tag) if tag else loc
            hint = f"set '{tag}' to one of the listed values" if kind == "union_tag_invalid" else f"add '{tag}:'"
        problems.append(SpecProblem(filename, lines.line_for(loc), _dotted(loc), message, hint))
    return sorted(problems, key=lambda p: p.line)
