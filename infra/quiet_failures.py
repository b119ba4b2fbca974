"""One message, not a traceback per layer, for failures that are the input's fault.

A malformed JSONL line or a full disk (DataError) says everything in its message: file and line, or the path and
what is free; so does a spec's problem (SpecError: a submitted spec that reads outside the worker's roots). Prefect
logs a failing task's traceback, then the flow's, and the CLI would print a third; for these errors the tracebacks
only hide the message. This filter keeps Prefect's log lines (with the error's repr) and drops their traceback for
DataErrors and SpecErrors only; every other failure keeps its traceback.
"""

from __future__ import annotations

import logging

from compass.infra.errors import DataError
from compass.specs.loader import SpecError

RUN_LOGGERS = ("prefect.task_runs", "prefect.flow_runs")


class DataErrorsWithoutTraceback(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and isinstance(record.exc_info[1], (DataError, SpecError)):
            record.exc_info = None
            record.exc_text = None
        return True


def quiet_data_errors() -> None:
    """Install the filter on Prefect's run loggers (once per process)."""
    for name in RUN_LOGGERS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, DataErrorsWithoutTraceback) for f in logger.filters):
            logger.addFilter(DataErrorsWithoutTraceback())
