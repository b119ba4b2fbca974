"""`compass run` in a terminal: the run's progress redrawn in place (rich's Live) under the lines it prints: one
row per training step running (its step, loss, rate and time left) and the run's bar (steps ended of the plan's,
with the whole run's time left from the plan's model corrected by the measured rates: flows/reports/run_clock.py).

It is a filter on the console handlers: the records it draws (a training step's progress line, the run's
`[12/40] ... done` line) are kept off the terminal as lines; every other record prints above the live rows. Not a
terminal (a pipe, CI, a file): nothing changes, every line is printed as before."""

from __future__ import annotations

import contextlib
import logging
import re
import threading

from rich.console import Console, Group
from rich.live import Live
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

from compass.flows.reports.progress import STEP_PROGRESS

RUN_DONE = re.compile(r"^\[(?P<done>\d+)/(?P<total>\d+)\] (?P<step>\S+) done: (?P<counts>.*?), \d+% of the plan in "
                      r"(?P<elapsed>\S+?)(?:; about (?P<left>\S+) left in the run.*)?$")


class LiveDisplay(logging.Filter):
    """The live rows (see the module docstring): start() before the run, stop() after it."""

    def __init__(self, console: Console):
        super().__init__()
        self.running: dict[str, Text] = {}  # step id -> its progress row, in the order they started
        self.done, self.total, self.counts, self.left = 0, 0, "", ""
        self.lock = threading.Lock()
        self.broken = False
        self.live = Live(self._render(), console=console, refresh_per_second=4, transient=True,
                         redirect_stdout=False, redirect_stderr=False)

    def start(self) -> None:
        try:
            self.live.start()
        except Exception:  # noqa: BLE001 - plain lines instead
            self.broken = True

    def stop(self) -> None:
        with contextlib.suppress(Exception):
            self.live.stop()

    def filter(self, record: logging.LogRecord) -> bool:
        """False for a record drawn in the live rows; a display that fails gives way to plain lines, never fails
        the run."""
        if self.broken:
            return True
        try:
            return self._drawn(record)
        except Exception:  # noqa: BLE001 - the terminal's display is never worth a run
            self.broken = True
            with contextlib.suppress(Exception):
                self.live.stop()
            return True

    def _drawn(self, record: logging.LogRecord) -> bool:
        if record.msg == STEP_PROGRESS and isinstance(record.args, tuple) and len(record.args) == 9:
            step, at, steps, percent, loss, rate, seen, left, goodput = record.args
            row = Text(f"  {step}  step {at}/{steps} {percent}%  loss {loss:.4f}  {rate} tokens/s  {seen} tokens"
                       + (f"  {str(left).removeprefix(', ')}" if left else ""))
            with self.lock:
                self.running[str(step)] = row
                self.live.update(self._render())
            return False
        ended = RUN_DONE.match(record.getMessage()) if record.name.startswith("prefect.flow_runs") else None
        if ended:
            with self.lock:
                self.running.pop(ended["step"], None)
                self.done, self.total = int(ended["done"]), int(ended["total"])
                self.counts = f"{ended['counts']} in {ended['elapsed']}"
                self.left = f"about {ended['left']} left in the run" if ended["left"] else ""
                self.live.update(self._render())
            return False
        return True

    def _render(self) -> Group:
        bar = Table.grid(padding=(0, 1))
        bar.add_row(Text(f"[{self.done}/{self.total or '?'}]"),
                    # its styles named: the console's theme (Prefect's) has none of rich's progress styles
                    ProgressBar(total=max(1, self.total), completed=self.done, width=30, style="grey35",
                                complete_style="green", finished_style="green", pulse_style="green"),
                    Text(f"{self.done / self.total:.0%}" if self.total else ""), Text(self.counts),
                    Text(self.left))
        return Group(*self.running.values(), bar)
