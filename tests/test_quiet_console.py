"""`compass run`'s quiet terminal (flows/quiet_console.py), in a process of its own whose stdout and stderr the test
reads: compass's and Prefect's run lines reach the terminal; a library's warning, a child process's output, bytes
written straight to fd 2 and a library's print() inside a step go to the log file; everything is back as it was
after. The end-to-end check (a whole `compass run`) is test_lifecycle's quiet_terminal."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SCRIPT = r"""
import logging, os, subprocess, sys
from pathlib import Path
import prefect  # its logging configuration: the console handler on its loggers and the root
from compass.flows.cli.common import err, out
from compass.flows.quiet_console import quiet_console

RUN = {"task_run_name": "curate:notes", "task_run_id": None, "flow_run_name": "minimal", "flow_run_id": None,
       "send_to_api": False}
with quiet_console(Path(sys.argv[1]), (out, err)):
    logging.getLogger("prefect.task_runs").info("curate:notes committed to /store in 1.0s: documents_out 40",
                                                extra=RUN)
    logging.getLogger("prefect.task_runs").info("Finished in state Completed()", extra=RUN)
    logging.getLogger("transformers.modeling_utils").warning("a library's warning")
    logging.getLogger("compass.trackers").warning("mlflow run not opened")
    record = logging.LogRecord("prefect.task_runs", logging.INFO, "-", 1, "printed by a library", None, None,
                               func="print_as_log")
    record.__dict__.update(RUN)
    logging.getLogger("prefect.task_runs").handle(record)
    err.print("compass's own line", markup=False)
    os.write(2, b"raw bytes on fd 2\n")
    print("a bar on stdout", flush=True)
    subprocess.run([sys.executable, "-c", "import sys; print('child out'); print('child err', file=sys.stderr)"])
print("after: stdout is the terminal again", flush=True)
logging.getLogger("prefect.task_runs").info("after: the console handler is the terminal's again", extra=RUN)
"""


def test_the_terminal_gets_compass_lines_and_the_log_file_the_rest(tmp_path: Path):
    log = tmp_path / "logs" / "run.log"
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(log)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    terminal = done.stdout + done.stderr
    kept = log.read_text()
    for line in ("curate:notes committed to /store in 1.0s: documents_out 40", "mlflow run not opened",
                 "compass's own line", "after: stdout is the terminal again",
                 "after: the console handler is the terminal's again"):
        assert line in terminal and line not in kept, line
    for line in ("a library's warning", "printed by a library", "raw bytes on fd 2", "a bar on stdout",
                 "child out", "child err"):
        assert line in kept and line not in terminal, line
    assert "Finished in state Completed()" not in terminal  # a task run's: its commit line said it
