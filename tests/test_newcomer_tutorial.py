"""The "write your own spec" tutorial (docs/tutorial.md, issue 45 item 12) is run as a reader runs it: every file it
shows is written where its title says, every command block is run in order from a folder holding the repository's
docs (the tutorial's data) and its environment, and the output it quotes is what the run printed: the same words and
integers, and each decimal within 20% of the quoted one (training on another CPU may round differently)."""

from __future__ import annotations

import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.conftest import REPO, VENV_BIN, base_env

pytestmark = pytest.mark.slow
TUTORIAL = REPO / "docs" / "tutorial.md"
FENCE = re.compile(r'^```(\w+)(?: title="([^"]+)")?\n(.*?)^```$', re.S | re.M)
DECIMAL = re.compile(r"\d+\.\d+")


@dataclass(frozen=True)
class Block:
    language: str
    title: str | None
    text: str

    @property
    def is_file(self) -> bool:  # a file the reader saves: its title is a path
        return self.title is not None and "/" in self.title and " " not in self.title


def blocks() -> list[Block]:
    return [Block(lang, title, text) for lang, title, text in FENCE.findall(TUTORIAL.read_text())]


def quoted_line_pattern(line: str) -> re.Pattern[str]:
    """The quoted line with each decimal number captured: the words and integers must be as quoted. A decimal may
    be printed without its fraction (4 significant digits: 316.04 prints as 316)."""
    parts = DECIMAL.split(line)
    return re.compile(r"(\d+(?:\.\d+)?)".join(re.escape(p) for p in parts))


def check_quoted(quoted: str, printed: str) -> None:
    printed_lines = [" ".join(line.split()) for line in printed.splitlines()]
    for line in quoted.strip().splitlines():
        pattern = quoted_line_pattern(" ".join(line.split()))
        found = [m for m in map(pattern.fullmatch, printed_lines) if m]
        assert found, f"the tutorial quotes {line!r}; the run printed:\n{printed[-3000:]}"
        for want, got in zip(DECIMAL.findall(line), found[0].groups(), strict=True):
            assert abs(float(got) - float(want)) <= 0.2 * float(want), (line, got)


def states(spec: Path) -> dict[str, str]:
    """Each step's state in `compass plan` (run or cached) against the spec's own store."""
    from compass.flows.compiler import compile_spec
    from compass.flows.reports.plan_status import plan_status
    from compass.infra.store import Store
    from compass.specs import load_spec

    loaded = load_spec(spec)
    store = Store(loaded.spec.how.storage.root_at(loaded.base_dir))
    return {s.step_id: s.state for s in plan_status(compile_spec(loaded.spec), store)}


def test_the_quoted_output_check_catches_other_words_and_far_numbers():
    quoted = ["success criteria MET: 1 of 1 pass", "  val_ppl:notes <= 1000.0 at post_train:sft: 316.9, pass"]
    check_quoted("\n".join(quoted), "x\n" + "\n".join(quoted).replace("316.9", "350.5"))  # within 20%
    check_quoted("\n".join(quoted), "\n".join(quoted).replace("316.9", "316"))  # 316.04 to 4 significant digits
    for i, other in ((0, "success criteria MET: 0 of 1 pass"),
                     (1, "val_ppl:notes <= 1000.0 at post_train:sft: 316.9, fail"),
                     (1, "val_ppl:notes <= 1000.0 at pretrain:decay: 316.9, pass"),
                     (1, "val_ppl:notes <= 1000.0 at post_train:sft: 900.0, pass")):
        printed = list(quoted)
        printed[i] = other
        with pytest.raises(AssertionError):
            check_quoted("\n".join(quoted), "\n".join(printed))


def test_the_tutorial_runs_as_written_and_prints_what_it_quotes(tmp_path: Path):
    (tmp_path / "docs").symlink_to(REPO / "docs")  # the tutorial's own text is its data
    (tmp_path / ".venv").symlink_to(VENV_BIN.parent)
    env = base_env(tmp_path / "prefect") | {"HF_HUB_OFFLINE": "1"}
    found = blocks()
    files = [b for b in found if b.is_file]
    assert {b.title for b in files} == {"my-run/make_data.py", "my-run/spec.yaml"}
    for block in files:
        (tmp_path / block.title).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / block.title).write_text(block.text)

    ran: list[tuple[str, str]] = []
    for i, block in enumerate(found):
        if block.language == "bash" and block.text.startswith("sed -i"):  # "run it again and nothing runs"
            assert set(states(tmp_path / "my-run" / "spec.yaml").values()) == {"cached"}
        if block.language == "bash":
            done = subprocess.run(["bash", "-ec", f"source .venv/bin/activate\n{block.text}"], cwd=tmp_path, env=env,
                                  capture_output=True, text=True, timeout=840)
            assert done.returncode == 0, (block.text, done.stdout[-3000:], done.stderr[-5000:])
            ran.append((block.text.strip(), done.stdout + done.stderr))
        elif block.language == "text":  # output the block before it printed
            assert ran and found[i - 1].language == "bash", f"quoted output without its command: {block.text}"
            check_quoted(block.text, ran[-1][1])
    commands = [command for command, _ in ran]
    assert commands == ["source .venv/bin/activate", "python my-run/make_data.py",
                        "compass validate my-run/spec.yaml", "compass plan my-run/spec.yaml",
                        "compass run my-run/spec.yaml",
                        "sed -i 's/name: general, tokens: 40000/name: general, tokens: 60000/' my-run/spec.yaml\n"
                        "compass why pretrain:decay my-run/spec.yaml"]
    changed = states(tmp_path / "my-run" / "spec.yaml")  # after the edit, as the tutorial says
    assert {k.split(":")[0] for k, v in changed.items() if v == "cached"} == {
        "ingest", "curate", "tokenizer", "tokenize", "fence_index", "decontaminate"}
    assert {k.split(":")[0] for k, v in changed.items() if v == "run"} == {
        "pretrain", "post_train", "evaluate", "curves", "report"}
    store = tmp_path / "my-run" / "store"  # where the tutorial says it writes
    for kind in ("pretrain/general-", "pretrain/decay-", "post_train/sft-", "report/success-"):
        assert list(store.glob(f"{kind}*/manifest.json")), kind
    assert len(list(store.glob("evaluate/*/results.json"))) == 3  # each model: two stages and SFT
