"""The malformed-spec corpus: each file fails with its own clear, located message (and nothing else)."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

from compass.flows.validation import load_checked
from compass.specs.loader import SpecError

BAD = sorted((Path(__file__).parent / "bad_specs").glob("*.yaml"))
EXPECT = re.compile(r"^# expect: (\d+): (.*)$", re.M)


def test_corpus_is_large_enough():
    assert len(BAD) >= 25


@pytest.mark.parametrize("path", BAD, ids=[p.stem for p in BAD])
def test_each_bad_spec_fails_with_its_message(path: Path, monkeypatch: pytest.MonkeyPatch):
    """Every problem of the file, in one run: its own rule's, and what the checks of later phases (this machine's:
    no Slurm controller, no CUDA) find in the sections that parsed."""
    monkeypatch.delenv("SLURM_CONF", raising=False)  # this machine's own Slurm: none (a test's cluster is not it)
    expects = [(int(line), msg) for line, msg in EXPECT.findall(path.read_text())]
    assert expects, f"{path.name} declares no expectation"
    with pytest.raises(SpecError) as info:
        load_checked(path)
    problems = info.value.problems
    rendered = [str(p) for p in problems]
    for line, msg in expects:
        assert any(p.line == line and msg in str(p) for p in problems), (line, msg, rendered)
    assert len(problems) == len(expects), rendered
    for p in problems:  # file:line: field.path: message (hint)
        assert str(p).startswith(f"{path}:{p.line}: "), str(p)


def test_messages_are_distinct_across_the_corpus():
    first_messages = set()
    for path in BAD:
        with pytest.raises(SpecError) as info:
            load_checked(path)
        first_messages.add(info.value.problems[0].message)
    assert len(first_messages) >= len(BAD) - 3  # a few cases share a rule on purpose (e.g. missing fields)


def test_cli_exits_2_lists_every_problem_and_writes_nothing(tmp_path: Path):
    spec = Path(__file__).parent / "bad_specs" / "several_errors_at_once.yaml"
    store = tmp_path / "store"
    for command in (["validate", str(spec)], ["plan", str(spec), "--store", str(store)],
                    ["run", str(spec), "--store", str(store)]):
        done = subprocess.run([sys.executable, "-m", "compass.flows.cli.app", *command], capture_output=True, text=True,
                              cwd=tmp_path, timeout=120)
        assert done.returncode == 2, done.stderr
        assert f"{spec}:" in done.stderr and "must divide" in done.stderr and "sum to 0.9" in done.stderr
        assert "2 problems" in done.stderr
    assert not store.exists()
    assert not (tmp_path / ".compass").exists()
