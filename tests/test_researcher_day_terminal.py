"""Live progress in a terminal (issue 75, item 6): under a terminal `compass run` redraws, in place below the lines
it prints, one row per training step running (its step, loss, rate and time left) and the run's bar with the whole
run's time left; through a pipe every line prints as before (test_lifecycle's quiet terminal)."""

from __future__ import annotations

import fcntl
import io
import logging
import os
import pty
import re
import struct
import subprocess
import termios
import time
from pathlib import Path

import pytest
from rich.console import Console

from compass.flows.live_display import LiveDisplay
from compass.flows.reports.progress import STEP_PROGRESS
from tests.conftest import VENV_BIN, base_env, seeded, write_minimal_spec


def record(name: str, msg: str, *args: object) -> logging.LogRecord:
    return logging.LogRecord(name, logging.INFO, __file__, 1, msg, args, None)


def test_a_training_steps_progress_and_the_runs_bar_are_drawn_not_printed():
    screen = io.StringIO()
    display = LiveDisplay(Console(file=screen, force_terminal=True, width=160))
    display.start()
    progress = record("prefect.task_runs", STEP_PROGRESS, "pretrain:stage1", 12, 48, "25", 6.5123, "3,400", "49.2k",
                      ", about 40s left", "; goodput 97%")
    assert display.filter(progress) is False  # drawn as a row, not printed as a line
    assert "pretrain:stage1  step 12/48 25%  loss 6.5123  3,400 tokens/s  49.2k tokens  about 40s left" in \
        display.running["pretrain:stage1"].plain
    ended = record("prefect.flow_runs", "[13/42] pretrain:stage1 done: 9 ran, 4 cached, 31% of the plan in 2m05s; "
                   "about 6m10s left in the run (the plan's model x 1.3, measured)")
    assert display.filter(ended) is False
    assert display.running == {} and (display.done, display.total) == (13, 42)
    assert display.left == "about 6m10s left in the run" and display.counts == "9 ran, 4 cached in 2m05s"
    committed = record("prefect.task_runs", "pretrain:stage1 committed to store/pretrain/stage1-ab in 62s")
    assert display.filter(committed) is True  # every other line prints above the rows
    display.stop()
    assert "━" in screen.getvalue() and "[13/42]" in screen.getvalue()


def run_in_a_terminal(argv: list[str], cwd: Path, env: dict[str, str], timeout: float) -> tuple[int, str]:
    """`argv` with its stdin, stdout and stderr a pseudo-terminal of 160 columns; what it drew, and its exit."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 50, 160, 0, 0))
    proc = subprocess.Popen(argv, cwd=cwd, env=env | {"TERM": "xterm-256color", "COLUMNS": "160"}, stdin=slave,
                            stdout=slave, stderr=slave, start_new_session=True)
    os.close(slave)
    shown = bytearray()
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            try:
                chunk = os.read(master, 65536)
            except OSError:  # EIO: every end of the terminal closed
                break
            if not chunk:
                break
            shown += chunk
        return proc.wait(timeout=max(1.0, deadline - time.monotonic())), shown.decode("utf-8", "replace")
    finally:
        os.close(master)
        if proc.poll() is None:
            proc.kill()


@pytest.mark.slow
def test_compass_run_in_a_terminal_redraws_its_progress_in_place(data_store: Path, prefect_server: str,
                                                                   tmp_path: Path):
    spec = write_minimal_spec(tmp_path, **{
        "tokens: 20000, sequence_length: 64": "tokens: 30000, sequence_length: 64",
        "how:\n": "how:\n  monitoring: {progress_every_s: 0.5}\n"})
    store = seeded(tmp_path / "store", data_store)  # the data steps committed: the stage trains at once
    env = base_env(tmp_path / "prefect") | {"PREFECT_API_URL": prefect_server}
    code, shown = run_in_a_terminal([str(VENV_BIN / "compass"), "run", str(spec), "--store", str(store), "--until",
                                     "pretrain:stage1"], tmp_path, env, timeout=600)
    assert code == 0, shown[-3000:]
    assert "\x1b[?25l" in shown and re.search(r"\x1b\[\d*A", shown)  # rich's live region: cursor hidden, moved up
    assert re.search(r"pretrain:stage1  step \d+/\d+ \S+%  loss \d", shown), shown[-3000:]  # the stage's row
    assert not re.search(r"pretrain:stage1: step \d+ of \d+", shown)  # not printed as lines
    assert re.search(r"\[\d+/\d+\] *━", shown) and "cached in" in shown  # the run's bar
    assert "pretrain:stage1 committed to" in shown  # the lines still print, above the rows
    assert "Results: " in shown.rsplit("\x1b[?25h", 1)[-1]  # and the summary, after the live region ended
