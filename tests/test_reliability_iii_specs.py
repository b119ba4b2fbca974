"""Specs that once crashed or printed what they should not (issue 46): a YAML merge key under an unknown top-level
key (`TypeError` from the line index), numbers that validate but cannot be carried out (R39: `tokens: 1e308`, a
billion retries), and terminal escape sequences or `:emoji:` codes in spec values and file names (R33-R35), which
now reach the terminal escaped and as text."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from tests.conftest import write_minimal_spec


def validate(spec: Path) -> str:
    from compass.flows.cli.app import app

    done = CliRunner().invoke(app, ["validate", str(spec)])
    assert done.exit_code == 2, done.output
    assert "Traceback" not in done.output
    return done.output


def test_a_merge_key_under_an_unknown_key_gives_located_problems(tmp_path: Path):
    spec = write_minimal_spec(tmp_path, **{"how:\n  parallelism: {micro_batch_size: 2}":
                                           "how:\n  parallelism:\n    <<: *defaults\n"})
    spec.write_text("x-defaults: &defaults\n  micro_batch_sise: 2\n" + spec.read_text())
    out = validate(spec)
    assert f"{spec}:1: x-defaults: unknown field 'x-defaults'" in out
    assert f"{spec}:2: how.parallelism.micro_batch_sise: unknown field 'micro_batch_sise' (did you mean " \
           "'micro_batch_size'?)" in out


@pytest.mark.parametrize(("old", "new", "field"), [
    ("tokens: 20000", "tokens: 1e308", "what.pretraining.stages[0].tokens"),
    ("how:\n", "how:\n  orchestration: {retries: 1000000000}\n", "how.orchestration.retries"),
    ("how:\n", "how:\n  orchestration: {max_parallel_steps: 1000000000}\n", "how.orchestration.max_parallel_steps"),
])
def test_R39_numbers_a_run_cannot_carry_out_are_refused(tmp_path: Path, old: str, new: str, field: str):
    out = " ".join(validate(write_minimal_spec(tmp_path, **{old: new})).split())
    assert f"{field}: Input should be less than or equal to" in out


def test_R33_R35_escape_sequences_and_emoji_codes_reach_the_terminal_as_text(tmp_path: Path):
    bad = '"corpus\\e[2J\\e[31mred"'  # YAML's \e: the escape character, written as YAML allows it
    spec = write_minimal_spec(tmp_path)
    spec.write_text(spec.read_text().replace(spec.read_text().split("uri: ")[1].split("\n")[0], bad, 1))
    out = validate(spec)
    assert "\x1b" not in out  # nothing raw: the terminal is not cleared or recoloured by a spec
    assert "corpus\\x1b[2J\\x1b[31mred" in out
    emoji = validate(write_minimal_spec(tmp_path, **{"how:\n": 'how:\n  ":notes:": 1\n'}))
    assert "unknown field ':notes:'" in emoji and "\U0001f3b6" not in emoji  # not turned into 🎶
