"""Specs built to hurt the loader (alias bombs, deep nesting, code-running tags, huge numbers, huge files) are
refused before anything is built from them: exit 2, file:line and a hint, no traceback."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from compass.specs.loader import SpecError, load_spec, load_spec_text
from tests.conftest import REPO, VENV_BIN

TINY = (REPO / "specs" / "examples" / "tiny.yaml").read_text()


def alias_bomb(levels: int = 9) -> str:
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x]"]
    lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]" for i in range(1, levels + 1)]
    return "\n".join(lines) + "\n"


HOSTILE = {
    "alias bomb": (alias_bomb(), 5, "expands to more than 10,000 values"),
    "deep nesting": ("name: " + "[" * 10_000 + "]" * 10_000 + "\n", 1, "nests deeper than 32 levels"),
    "python tag": ("name: !!python/object/apply:os.system ['touch /tmp/pwned']\n", 1,
                   "YAML tag tag:yaml.org,2002:python/object/apply:os.system is not allowed"),
    "custom tag": ("name: x\nseed: !secret 3\n", 2, "YAML tag !secret is not allowed"),
    "huge integer": ("name: x\nseed: " + "9" * 5000 + "\n", 2, "an integer of 5000 digits"),
    "huge value": ("name: x\ndescription: " + "a" * 50_000 + "\n", 2, "a value of 50,000 characters"),
    "huge file": (TINY + "".join(f"extra{i}: {'v' * 40}\n" for i in range(25_000)), 1,
                  "more than the limit of 1,048,576"),
}


@pytest.mark.parametrize("name", list(HOSTILE))
def test_hostile_yaml_is_refused_with_its_line(name: str):
    text, line, message = HOSTILE[name]
    with pytest.raises(SpecError) as info:
        load_spec_text(text, "hostile.yaml")
    (problem,) = info.value.problems
    assert problem.line == line and message in problem.message and problem.hint, str(problem)
    assert str(problem).startswith(f"hostile.yaml:{line}: <yaml>: ")


def test_anchors_within_limits_still_work():
    text = TINY.replace("how:", "x-mixture: &mix {docs_en: 1.0}\nhow:", 1)
    with pytest.raises(SpecError) as info:  # an unknown top-level key, found by the schema, not by the limits
        load_spec_text(text, "anchors.yaml")
    assert "x-mixture" in str(info.value) and "<yaml>" not in str(info.value)


def test_size_limit_is_checked_before_reading_and_can_be_raised(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    spec = tmp_path / "big.yaml"
    spec.write_text(TINY + "# " + "x" * 1_100_000 + "\n")
    with pytest.raises(SpecError, match="more than the limit of 1,048,576"):
        load_spec(spec)
    monkeypatch.setenv("COMPASS_MAX_SPEC_BYTES", str(2 << 20))
    assert load_spec(spec).spec.name  # the same file within a raised limit


def test_cli_exits_2_without_a_traceback(tmp_path: Path):
    spec = tmp_path / "bomb.yaml"
    spec.write_text(alias_bomb())
    done = subprocess.run([str(VENV_BIN / "compass"), "validate", str(spec)], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2
    assert f"{spec}:5: <yaml>: the spec expands to more than 10,000 values" in done.stderr
    assert "Traceback" not in done.stderr + done.stdout
