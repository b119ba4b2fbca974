"""Step identity under random single-field mutations of `how`, and under random mutations of the files a spec names:
each mutation must re-run exactly the steps whose identity it changes and their descendants: 0 false reuses (a step
whose output the change alters, found committed) and 0 needless re-runs (a step whose output it does not change,
run again).

The oracle reads the classification (specs/how.py `field_identity`, `StepKind.reads_how`): a "results" field
changes the steps whose kind reads it (unless their config sets it: `StepConfig.sets_how`) and everything
downstream of them; a "numerics" or "placement" field changes nothing. The fingerprints are the compiler's. A
mutation the schema refuses is drawn again (counted apart).

File mutations (`--files N`): a copy of the suite's minimal spec whose source, SFT dataset and local tokenizer
candidate are folders of its own; each mutation edits a file of one of them (its content at the same size, its
size, its name, a file added or removed; under `how.storage.input_stamps: content` also a touch that keeps the
bytes, which must re-run nothing). The oracle: the step that reads the field (the source's ingest, the dataset's
post-training step and the fence that scans it, the tokenizer selection) and every step downstream.

    python benchmarks/identity_mutations.py [--mutations 500] [--files 100] [--seed 0]
"""

from __future__ import annotations

import argparse
import random
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError

REPO = Path(__file__).resolve().parent.parent
# the example specs that load without a hub cache (smollm3-finetune.yaml starts from a cached hub model), and the
# test suite's minimal spec
SPECS = (REPO / "specs" / "examples" / "tiny.yaml", REPO / "specs" / "examples" / "smollm3-3b.yaml",
         REPO / "tests" / "specs" / "minimal.yaml")
# "results" fields that reach steps through a value derived from them, or through a builder's config
DERIVED = {"parallelism.engine": "parallelism.engine_name", "parallelism.deepspeed": "parallelism.engine_name"}
THROUGH_CONFIG = {"evaluation.every_checkpoint": "evaluate"}


@dataclass(frozen=True)
class Outcome:
    spec: str
    path: str
    identity: str
    false_reuses: tuple[str, ...]
    needless_reruns: tuple[str, ...]


def _annotation_at(path: str) -> Any:
    from compass.specs.how import How

    model: Any = How
    annotation: Any = None
    for part in path.split("."):
        annotation = model.model_fields[part].annotation
        model = next((a for a in (annotation, *typing.get_args(annotation))
                      if isinstance(a, type) and issubclass(a, BaseModel)), None)
    return annotation


def _candidates(annotation: Any, value: Any) -> list[Any]:
    """Values of the field's type other than `value` (the schema then accepts or refuses each)."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Annotated:
        return _candidates(args[0], value)
    if origin in (typing.Union, types.UnionType):
        return [c for a in args if a is not type(None) for c in _candidates(a, value)] + \
               ([None] if type(None) in args and value is not None else [])
    if origin is typing.Literal:
        return [a for a in args if a != value]
    if origin is list:
        return [[*(value or []), extra] for extra in ("tensorboard", "trackio", "node9")]
    if origin is dict:
        return [{**(value or {}), "pretrain": 3600.0}]
    if annotation is bool:
        return [not value]
    if annotation is int:
        base = value if isinstance(value, int) and not isinstance(value, bool) else 1
        return [base + 1, base * 2, 1024 + base]
    if annotation is float:
        base = float(value) if isinstance(value, int | float) else 1.0
        return [base / 2, base * 1.5, base + 1]
    if annotation is str:
        return ["mutated", "10", "127.0.0.2", "http://127.0.0.1:5000", "0 * * * *", "s3://bucket/mutated"]
    return []


def _set(data: dict[str, Any], path: str, value: Any) -> dict[str, Any]:
    out = dict(data)
    head, _, rest = path.partition(".")
    out[head] = _set(dict(out.get(head) or {}), rest, value) if rest else value
    return out


def mutate(spec: Any, path: str, rng: random.Random) -> Any | None:
    """The spec with `how.<path>` set to another value its schema accepts, or None when it accepts none tried."""
    from compass.specs.how import How
    from compass.specs.how_identity import value_at

    current = value_at(spec.how, path)
    options = _candidates(_annotation_at(path), current)
    rng.shuffle(options)
    data = spec.how.model_dump(mode="json", exclude_unset=True)
    for value in options:
        try:
            how = How.model_validate(_set(data, path, value))
        except ValidationError:
            continue
        if value_at(how, path) != current:
            return spec.model_copy(update={"how": how})
    return None


def expected_changes(plan: Any, before: Any, after: Any, path: str) -> set[str]:
    """What the classification says must run again: the reading steps and every step downstream of them."""
    from compass.specs.how_identity import identity_of, value_at
    from compass.tasks.steps import registry

    if identity_of(path) != "results":
        return set()
    read = DERIVED.get(path, path)
    if read != path and value_at(before.how, read) == value_at(after.how, read):
        return set()  # the derived value is the same (engine: deepspeed where deepspeed: true said it already)
    return _downstream(plan, {s.id for s in plan.steps
                              if (read in registry.kind(s.kind).reads_how and read not in s.config.sets_how())
                              or s.kind == THROUGH_CONFIG.get(path)})


def run(mutations: int, seed: int) -> tuple[list[Outcome], int]:
    from compass.flows.compiler import compile_spec
    from compass.specs import load_spec
    from compass.specs.how_identity import classification, identity_of

    rng = random.Random(seed)
    specs = {path.name: load_spec(path).spec for path in SPECS}
    plans = {name: compile_spec(spec) for name, spec in specs.items()}
    paths = sorted(p for p in classification() if p not in DERIVED.values())  # fields only, not derived values
    outcomes: list[Outcome] = []
    refused = 0
    while len(outcomes) < mutations:
        name, path = rng.choice(list(specs)), rng.choice(paths)
        before = specs[name]
        after = mutate(before, path, rng)
        if after is None:
            refused += 1
            continue
        plan = plans[name]
        new = compile_spec(after)
        assert [s.id for s in new.steps] == [s.id for s in plan.steps], f"{path} changed the steps of {name}"
        actual = {s for s in plan.fingerprints if plan.fingerprints[s] != new.fingerprints[s]}
        expected = expected_changes(plan, before, after, path)
        outcomes.append(Outcome(name, path, identity_of(path), tuple(sorted(expected - actual)),
                                tuple(sorted(actual - expected))))
    return outcomes, refused


FILE_KINDS = ("content", "size", "rename", "add", "remove", "touch")
READERS = {"source": ("ingest:notes",), "dataset": ("post_train:chat",), "tokenizer": ("tokenizer:",)}


def _file_fixture(folder: Path, content_stamps: bool) -> dict[str, Path]:
    """The minimal spec in `folder` with a source, an SFT dataset and a local tokenizer of its own; {field: the
    folder it names}."""
    import json
    import shutil
    import sys

    sys.path.insert(0, str(REPO))
    from tests.conftest import FIXTURES, write_minimal_spec

    source, dataset, tokenizer = folder / "notes", folder / "sft", folder / "tok"
    shutil.copytree(FIXTURES / "corpus" / "en", source)
    dataset.mkdir()
    for part in range(3):
        (dataset / f"part{part}.jsonl").write_text("".join(json.dumps({"messages": [
            {"role": "user", "content": f"{i} + {part}?"}, {"role": "assistant", "content": f"{i + part}."}]}) + "\n"
            for i in range(6)))
    tokenizer.mkdir()
    (tokenizer / "tokenizer.json").write_text('{"version": "1.0", "model": {"type": "BPE"}}')
    (tokenizer / "tokenizer_config.json").write_text('{"model_max_length": 64}')
    how = "how:\n  storage: {input_stamps: content}\n" if content_stamps else "how:\n"
    write_minimal_spec(folder, **{
        f"{FIXTURES}/corpus/en": str(source),
        "      - {kind: bpe, vocab_size: 400}\n": "      - {kind: bpe, vocab_size: 400}\n"
                                               f"      - {{kind: local, name: mine, path: {tokenizer}}}\n",
        "  pretraining:": f"  post_training:\n    - {{method: sft, name: chat, dataset: {dataset}, lr: 1.0e-3}}\n"
                          "  pretraining:",
        "how:\n": how})
    return {"source": source, "dataset": dataset, "tokenizer": tokenizer}


def _mutate_file(folder: Path, kind: str, rng: random.Random) -> None:
    import os

    files = sorted(p for p in folder.rglob("*") if p.is_file())
    path = rng.choice(files)
    if kind == "content":  # the same size, other bytes
        data = bytearray(path.read_bytes())
        at = rng.randrange(len(data))
        data[at] = ord("#") if data[at] != ord("#") else ord("%")
        path.write_bytes(bytes(data))
    elif kind == "size":
        with open(path, "a") as f:
            f.write(" and one more line.\n")
    elif kind == "rename":
        path.rename(path.with_name(f"renamed-{rng.randrange(10**6)}{path.suffix}"))
    elif kind == "add":
        path.with_name(f"added-{rng.randrange(10**6)}{path.suffix}").write_bytes(path.read_bytes())
    elif kind == "remove":
        path.unlink()
    elif kind == "touch":  # the same bytes, another date
        os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns + rng.randrange(1, 10**9)))


def _downstream(plan: Any, steps: set[str]) -> set[str]:
    """`steps` and every step that reads one of them, transitively."""
    grew = True
    while grew:
        more = {s.id for s in plan.steps if set(s.inputs.values()) & steps} - steps
        steps |= more
        grew = bool(more)
    return steps


def run_files(mutations: int, seed: int) -> list[Outcome]:
    """Random file mutations of the fixture's folders (module docstring), each judged against the oracle."""
    import shutil
    import tempfile

    from compass.flows.compiler import compile_spec
    from compass.specs import load_spec

    rng = random.Random(seed)
    outcomes = []
    with tempfile.TemporaryDirectory(prefix="identity-files-") as scratch:
        for i in range(mutations):
            content = rng.random() < 0.5
            kind = rng.choice(FILE_KINDS if content else FILE_KINDS[:-1])  # a touch re-runs under listing stamps
            field = rng.choice(sorted(READERS))
            folder = Path(scratch) / str(i)
            folders = _file_fixture(folder, content)
            spec = folder / "spec.yaml"
            before = compile_spec(load_spec(spec).spec)
            _mutate_file(folders[field], kind, rng)
            after = compile_spec(load_spec(spec).spec)
            actual = {s for s in before.fingerprints if before.fingerprints[s] != after.fingerprints[s]}
            readers = {s.id for s in before.steps if any(s.id.startswith(r) for r in READERS[field])}
            if field == "dataset":  # the fence scans what post-training draws
                readers |= {s.id for s in before.steps if s.kind == "decontaminate"}
            expected = set() if kind == "touch" else _downstream(before, readers)
            outcomes.append(Outcome("minimal.yaml", f"{field}:{kind}{' (content stamps)' if content else ''}",
                                    "files", tuple(sorted(expected - actual)), tuple(sorted(actual - expected))))
            shutil.rmtree(folder)
    return outcomes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mutations", type=int, default=500)
    parser.add_argument("--files", type=int, default=100, help="file mutations (0: none)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    outcomes, refused = run(args.mutations, args.seed)
    by_class = {c: sum(o.identity == c for o in outcomes) for c in ("results", "numerics", "placement")}
    false_reuses = [o for o in outcomes if o.false_reuses]
    needless = [o for o in outcomes if o.needless_reruns]
    print(f"identity mutations: {len(outcomes)} single-field mutations of how over {', '.join(p.name for p in SPECS)} "
          f"({', '.join(f'{n} {c}' for c, n in by_class.items())}; {refused} drawn again: refused by the schema)")
    print(f"fields mutated: {len({o.path for o in outcomes})}")
    print(f"false reuses: {len(false_reuses)}")
    print(f"needless re-runs: {len(needless)}")
    for o in (false_reuses + needless)[:20]:
        print(f"  {o.spec} how.{o.path} ({o.identity}): reused {list(o.false_reuses)}, re-ran "
              f"{list(o.needless_reruns)}")
    files = run_files(args.files, args.seed) if args.files else []
    file_reuses = [o for o in files if o.false_reuses]
    file_needless = [o for o in files if o.needless_reruns]
    if files:
        kinds = sorted({o.path for o in files})
        print(f"file mutations: {len(files)} over {len(READERS)} file-reading fields ({len(kinds)} field and "
              f"mutation kinds)")
        print(f"file false reuses: {len(file_reuses)}")
        print(f"file needless re-runs: {len(file_needless)}")
        for o in (file_reuses + file_needless)[:20]:
            print(f"  {o.path}: reused {list(o.false_reuses)}, re-ran {list(o.needless_reruns)}")
    return 0 if not (false_reuses or needless or file_reuses or file_needless) else 1


if __name__ == "__main__":
    raise SystemExit(main())
