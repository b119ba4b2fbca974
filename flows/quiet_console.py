"""What `compass run` shows on the terminal: compass's own lines (each step's start and commit with its key numbers,
a progress line per training step every how.monitoring.progress_every_s, warnings and failures, the summary).
Everything else the run writes (third-party progress bars and warnings, datatrove's logs and stats, the training
ranks' and the temporary server's output) goes to the run's log file, named on the first line; `--verbose` shows
it all on the terminal instead. On a terminal, the training steps' progress and the run's bar are redrawn in place
below the lines (flows/live_display.py).

The split is made on file descriptors 1 and 2, so the processes the run starts (datatrove's workers, torchrun's
ranks) write to the log file as well; compass's lines go to a duplicate of the terminal's descriptors."""

from __future__ import annotations

import logging
import os
import re
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TextIO

from rich.console import Console

from compass.flows.live_display import LiveDisplay
from compass.infra.redact import redact

SHOWN = ("prefect", "compass")  # loggers whose records reach the terminal; the others go to the log file
REDUNDANT = ("Finished in state Completed()",)  # a task run's: compass's commit line already said it


class _TerminalFilter(logging.Filter):
    """Prefect's console handler keeps compass's and Prefect's records, minus the redundant ones, cleaned."""

    def filter(self, record: logging.LogRecord) -> bool:
        return _shown(record) and _cleaned(record)


class _LogFileFilter(logging.Filter):
    """The records the terminal leaves out, for the log file, cleaned."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not _shown(record) and _cleaned(record)


CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f\u2028\u2029]")  # but tab and newline: escapes, returns, bells


def _cleaned(record: logging.LogRecord) -> bool:
    """The record's message as it may be shown: any URL password or query credential as *** (a library's message
    passing a connection string through); control characters written as escapes (a terminal escape sequence or a
    carriage return in a file name); every line after the first indented, so a name holding a newline cannot
    print a line that poses as a record of its own ("12:00:00 | ERROR | ..."). Always True."""
    message = record.getMessage()
    shown = CONTROL.sub(lambda m: repr(m.group())[1:-1], redact(message)).replace("\n", "\n    ")
    if shown != message:
        record.msg, record.args = shown, ()
    return True


def _shown(record: logging.LogRecord) -> bool:
    if not record.name.startswith(SHOWN) or record.funcName == "print_as_log":  # a library's print() in a step
        return False
    return not (record.name == "prefect.task_runs" and record.getMessage() in REDUNDANT)


def _console_handlers() -> list[logging.StreamHandler]:
    """Prefect's console handler(s), wherever logging.yml attached them (its loggers and the root); Prefect's
    logging is configured first if nothing in this process has done it yet."""
    from prefect.logging.configuration import ensure_logging_setup
    from prefect.logging.handlers import PrefectConsoleHandler

    ensure_logging_setup()

    loggers = [logging.getLogger()] + [logging.getLogger(n) for n in list(logging.root.manager.loggerDict)]
    found: dict[int, logging.StreamHandler] = {}
    for logger in loggers:
        for handler in getattr(logger, "handlers", []):
            if isinstance(handler, PrefectConsoleHandler):
                found[id(handler)] = handler
    return list(found.values())


@contextmanager
def quiet_console(log_path: Path, consoles: tuple[Console, Console]) -> Iterator[TextIO]:
    """Within: fds 1 and 2 write to `log_path`; Prefect's console handler and compass's `out`/`err` consoles write
    to the terminal (yields the terminal's stderr)."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    terminal_out = os.fdopen(os.dup(1), "w", buffering=1, encoding="utf-8", errors="replace")
    terminal_err = os.fdopen(os.dup(2), "w", buffering=1, encoding="utf-8", errors="replace")
    saved = (os.dup(1), os.dup(2))
    log_fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(log_fd, 1)
    os.dup2(log_fd, 2)
    os.close(log_fd)
    out, err = consoles
    out.file, err.file = terminal_out, terminal_err
    handlers = _console_handlers()
    streams = [(h, h.stream, h.console.file) for h in handlers]  # type: ignore[attr-defined]
    interactive = {id(h): h.console.is_interactive for h in handlers}  # type: ignore[attr-defined]
    shown, kept = _TerminalFilter(), _LogFileFilter()
    for handler in handlers:
        handler.setStream(terminal_err)
        handler.console.file = terminal_err  # type: ignore[attr-defined]
        # rich judged interactivity when Prefect made the console, on the stream of that moment (the log file by
        # now): judged again for the terminal it now writes to, or rich's live display never draws in place
        handler.console.is_interactive = terminal_err.isatty()  # type: ignore[attr-defined]
        handler.addFilter(shown)
    on_terminal = bool(handlers) and terminal_err.isatty()
    display = LiveDisplay(handlers[0].console) if on_terminal else None  # type: ignore[attr-defined]
    for handler in handlers if display else ():
        handler.addFilter(display)
    to_file = logging.StreamHandler(sys.stderr)  # fd 2: the log file
    to_file.setLevel(logging.INFO)
    to_file.addFilter(kept)
    logging.getLogger().addHandler(to_file)
    if display:
        display.start()
    try:
        yield terminal_err
    finally:
        if display:
            display.stop()
        logging.getLogger().removeHandler(to_file)
        for handler, stream, file in streams:
            handler.removeFilter(shown)
            if display:
                handler.removeFilter(display)
            handler.setStream(stream)
            handler.console.file = file  # type: ignore[attr-defined]
            handler.console.is_interactive = interactive[id(handler)]  # type: ignore[attr-defined]
        out.file = err.file = None  # type: ignore[assignment]  # back to sys.stdout / sys.stderr
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for fd in saved:
            os.close(fd)
        terminal_out.close()
        terminal_err.close()
