"""Ending a run promptly on SIGTERM or Ctrl-C.

Prefect turns SIGTERM into `TerminationSignal` (Ctrl-C is `KeyboardInterrupt`) in the main thread, records
the run as crashed or cancelled, and re-raises. Steps, though, execute in worker threads, and Python waits for
those at exit, so a training step kept the process alive until it finished. Nothing needs them to finish:
every committed artifact is already durable (commits are atomic) and the step in flight resumes from its last
checkpoint on the next run. So once Prefect has had a moment to report, the processes the steps started are
ended and the process exits with the signal's conventional status.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading

GRACE_SECONDS = 5.0  # for Prefect to record the final state and flush its logs


def exit_code(exc: BaseException) -> int:
    return 130 if isinstance(exc, KeyboardInterrupt) else 143


def end_soon(exc: BaseException, grace: float = GRACE_SECONDS) -> None:
    """Exit `grace` seconds from now, whatever the step threads are doing."""
    logging.getLogger("compass").warning("interrupted (%s): committed steps are kept; the step in flight "
                                         "resumes from its last checkpoint on the next run", type(exc).__name__)
    timer = threading.Timer(grace, _exit_now, (exit_code(exc),))
    timer.daemon = True
    timer.start()


def _exit_now(code: int) -> None:
    end_children()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    os._exit(code)


def end_children(timeout: float = 5.0) -> None:
    """Terminate every process this one started (training launchers, data workers, an embedded server)."""
    import psutil

    children = psutil.Process().children(recursive=True)
    for child in children:
        with contextlib.suppress(psutil.NoSuchProcess):
            child.terminate()
    _, alive = psutil.wait_procs(children, timeout=timeout)
    for child in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            child.kill()
