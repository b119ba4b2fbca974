"""Issue #30, part II: the YAML limits hold on the loader's own parse whatever lines precede the breach (the
project's `{metric: val_ppl:notes}` once switched them all off), numbers are finite, and store roots that cannot
hold a store end in exit 2 with the reason. A bad input ends in exit 2 with its line and a fix, nothing written."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from compass.specs.loader import SpecError, load_spec_text
from tests.conftest import REPO, VENV_BIN, Cli, base_env, write_minimal_spec

MINIMAL = (REPO / "tests" / "specs" / "minimal.yaml").read_text()
FLOW_COLON = "    - {metric: val_ppl:notes, op: \"<=\", threshold: 1000, checkpoint: final}\n"
STAGE1 = ("      - {name: stage1, tokens: 20000, sequence_length: 64, global_batch_size: 4, "
          "mixture: {notes: 0.7, code: 0.3}}\n")
TAIL_LINE = MINIMAL.count("\n") + 1  # the first line appended after the minimal spec


def alias_bomb(levels: int = 9) -> str:
    lines = ["b0: &a0 [x, x, x, x, x, x, x, x, x]"]
    lines += [f"b{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]" for i in range(1, levels + 1)]
    return "\n".join(lines) + "\n"


# Started from a small launcher process: Linux carries ru_maxrss across fork and exec, so a child forked straight
# from this test process (a pytest worker holding torch) would report this process's size as its own.
CAPPED = """
import os, resource, subprocess, sys
def cap():
    resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))
with open(sys.argv[1], "w") as out:
    proc = subprocess.Popen(sys.argv[3:], stdout=out, stderr=subprocess.STDOUT, preexec_fn=cap)
    _, status, usage = os.wait4(proc.pid, 0)  # this child's own peak memory, not all children's
open(sys.argv[2], "w").write(str(usage.ru_maxrss))
sys.exit(os.waitstatus_to_exitcode(status))
"""


def compass_capped(*args: str, cwd: Path) -> tuple[int, str, int]:
    """`compass ...` under a 1 GiB address-space cap (a runaway fails fast instead of taking the machine):
    exit code, stderr and stdout, and the child's own peak resident memory in MB."""
    done = subprocess.run([sys.executable, "-c", CAPPED, str(cwd / "out.txt"), str(cwd / "peak.txt"),
                           str(VENV_BIN / "compass"), *args], cwd=cwd, env=base_env(cwd / "home"))
    peak_kib = int((cwd / "peak.txt").read_text())
    return done.returncode, (cwd / "out.txt").read_text(), peak_kib // 1024


def test_alias_bomb_after_a_flow_colon_exits_2_fast_and_small(tmp_path: Path):
    assert FLOW_COLON in MINIMAL  # the line libyaml refuses, which switched every limit off
    spec = tmp_path / "bomb.yaml"
    spec.write_text(MINIMAL + alias_bomb())
    started = time.monotonic()
    code, output, peak_mb = compass_capped("validate", str(spec), cwd=tmp_path)
    assert code == 2, output[-2000:]
    assert f"{spec}:{TAIL_LINE + 4}: <yaml>: the spec expands to more than 10,000 values" in output
    assert "Traceback" not in output and "check anchors and aliases" in output
    assert peak_mb < 200 and time.monotonic() - started < 30, (peak_mb, time.monotonic() - started)


AFTER_FLOW_COLON = {
    "long line": ("description: " + "a" * 900_000 + "\n", "a line of 900,013 characters"),
    "long value": ("description: |\n" + ("  " + "a" * 99 + "\n") * 9000, "a value of 900,000 characters"),
    "5000-digit integer": ("seed: " + "9" * 5000 + "\n", "an integer of 5000 digits"),
    "hex integer": ("seed: 0x" + "f" * 40 + "\n", "an integer of 42 digits"),
    "explicit int tag": ("seed: !!int " + "7" * 5000 + "\n", "an integer of 5000 digits"),
    "deep nesting": ("x: " + "[" * 100 + "]" * 100 + "\n", "nests deeper than 32 levels"),
    "python tag": ("x: !!python/object/apply:os.system ['true']\n", "YAML tag tag:yaml.org,2002:python/object"),
}


@pytest.mark.parametrize("name", list(AFTER_FLOW_COLON))
def test_limits_hold_after_a_flow_colon(name: str):
    tail, message = AFTER_FLOW_COLON[name]
    started = time.process_time()  # CPU time: other processes on the machine do not count
    with pytest.raises(SpecError) as info:
        load_spec_text(MINIMAL + tail, "spec.yaml")
    assert time.process_time() - started < 1.0
    (problem,) = info.value.problems
    assert str(problem).startswith(f"spec.yaml:{TAIL_LINE}: <yaml>: ") and message in problem.message, str(problem)
    assert problem.hint


MERGES = {  # the second stage written with a merge key (<<), each form; it must come out as stage1b, 30,000 tokens
    "alias": STAGE1.replace("- {", "- &s1 {") + "      - {<<: *s1, name: stage1b, tokens: 30000}\n",
    "list": STAGE1.replace("- {", "- &s1 {") + "      - {<<: [{tokens: 30000}, *s1], name: stage1b}\n",
    "inline mapping": STAGE1 + "      - {<<: {name: stage1b, tokens: 30000, sequence_length: 64}, global_batch_size: 4,"
                               "\n         mixture: {notes: 0.7, code: 0.3}}\n",
}


@pytest.mark.parametrize("form", list(MERGES))
def test_merge_keys_are_merged(form: str):
    stages = load_spec_text(MINIMAL.replace(STAGE1, MERGES[form]), "merge.yaml").spec.what.pretraining.stages
    assert [(s.name, s.tokens) for s in stages[:2]] == [("stage1", 20000), ("stage1b", 30000)]
    assert stages[1].global_batch_size == 4 and stages[1].mixture == {"notes": 0.7, "code": 0.3}


def test_a_merged_value_is_reported_on_the_line_it_was_written():
    anchor_line = MINIMAL[:MINIMAL.index(STAGE1)].count("\n") + 1
    bad = STAGE1.replace("- {", "- &s1 {").replace("global_batch_size: 4", "global_batch_size: -4")
    text = MINIMAL.replace(STAGE1, bad + "      - {<<: *s1, name: stage1b}\n")
    with pytest.raises(SpecError) as info:
        load_spec_text(text, "merge.yaml")
    found = {(p.path, p.line) for p in info.value.problems}
    assert found == {("what.pretraining.stages[0].global_batch_size", anchor_line),
                     ("what.pretraining.stages[1].global_batch_size", anchor_line)}, info.value.problems


BAD_YAML = {
    "%YAML 1.3": ("%YAML 1.3\n---\n", 1, "%YAML 1.3 is not supported"),
    "impossible date": ("x: 2001-02-30\n", TAIL_LINE, "cannot read '2001-02-30'"),
    "bad bool": ("x: !!bool maybe\n", TAIL_LINE, "cannot read 'maybe'"),
}


@pytest.mark.parametrize("name", list(BAD_YAML))
def test_yaml_that_does_not_build_is_a_located_spec_error(name: str):
    extra, line, message = BAD_YAML[name]
    text = extra + MINIMAL if extra.startswith("%") else MINIMAL + extra
    with pytest.raises(SpecError) as info:
        load_spec_text(text, "bad.yaml")
    (problem,) = info.value.problems
    assert problem.line == line and message in problem.message and problem.hint, str(problem)


NON_FINITE = {
    "lr": ("  pretraining:\n", "  pretraining:\n    optimizer: {lr: .inf}\n", "what.pretraining.optimizer.lr"),
    "rope_theta": ("rope_theta: 10000", "rope_theta: .inf", "what.architecture.positions.rope_theta"),
    "threshold": ("threshold: 1000", "threshold: .nan", "why.success_criteria[0].threshold"),
    "tokens": ("tokens: 20000", "tokens: .inf", "what.pretraining.stages[0].tokens"),
    "overflowing float": ("tokens: 20000", "tokens: 1e400", "what.pretraining.stages[0].tokens"),
    "mixture weight": ("{notes: 0.7, code: 0.3}", "{notes: .NaN, code: 0.3}",
                       "what.pretraining.stages[0].mixture.notes"),
    "filter param": ("{min_doc_words: 20}", "{min_doc_words: 20, max_symbol_word_ratio: -.inf}",
                     "what.data.sources[0].curation.filters[1].params"),
}


@pytest.mark.parametrize("name", list(NON_FINITE))
def test_infinite_and_nan_numbers_are_refused_with_line_and_field(name: str):
    old, new, field = NON_FINITE[name]
    assert old in MINIMAL
    text = MINIMAL.replace(old, new, 1)
    line = next(i for i, row in enumerate(text.splitlines(), 1) if new.strip().splitlines()[-1] in row)
    with pytest.raises(SpecError) as info:
        load_spec_text(text, "spec.yaml")
    (problem,) = info.value.problems
    assert (problem.line, problem.path) == (line, field), str(problem)
    assert "finite" in str(problem) and ".inf and .nan are not allowed" in str(problem)


def test_infinite_tokens_exit_2_from_the_cli(tmp_path: Path):
    spec = write_minimal_spec(tmp_path, **{"tokens: 20000": "tokens: .inf"})
    line = spec.read_text()[:spec.read_text().index(".inf")].count("\n") + 1
    done = Cli(tmp_path, base_env(tmp_path / "home"))("plan", str(spec), check=False, timeout=300)
    assert done.returncode == 2, done.stderr[-2000:]
    assert f"{spec}:{line}: what.pretraining.stages[0].tokens: Input should be a finite number" in done.stderr
    assert "Traceback" not in done.stderr + done.stdout


@pytest.fixture
def work(tmp_path: Path) -> Path:
    """The folder the CLI runs in; nothing else is written there, so a listing shows what a command wrote."""
    (tmp_path / "work").mkdir()
    return tmp_path / "work"


@pytest.fixture
def cli(tmp_path: Path, work: Path) -> Cli:
    return Cli(work, base_env(tmp_path / "home"))


def test_verify_of_a_missing_store_is_an_error_and_creates_nothing(work: Path, cli: Cli):
    missing = work / "no-such-store"
    done = cli("verify", str(missing), check=False, timeout=120)
    assert done.returncode == 2 and f"{missing}: no store here, nothing to verify" in done.stderr, done.stderr
    assert not missing.exists() and "Traceback" not in done.stderr


STORE_ROOTS = {
    "a file": ("afile", "is a file, not a folder"),
    "a folder under a file": ("afile/sub", "afile is a file, so there can be no folder"),
    "an http URL": ("http://127.0.0.1:9/store", "http:// cannot hold a store"),
}


@pytest.mark.parametrize("name", list(STORE_ROOTS))
@pytest.mark.parametrize("command", ["plan", "verify"])
def test_a_store_root_that_cannot_hold_a_store_exits_2_with_the_reason(work: Path, cli: Cli, command: str,
                                                                       name: str):
    (work / "afile").write_text("not a store\n")
    given, reason = STORE_ROOTS[name]
    root = given if "://" in given else str(work / given)
    args = ["plan", str(write_minimal_spec(work)), "--store", root] if command == "plan" else ["verify", root]
    before = sorted(p.name for p in work.iterdir())
    done = cli(*args, check=False, timeout=300)
    assert done.returncode == 2 and reason in done.stderr, done.stderr[-2000:]
    assert "Traceback" not in done.stderr + done.stdout
    assert sorted(p.name for p in work.iterdir()) == before and (work / "afile").read_text() == "not a store\n"
