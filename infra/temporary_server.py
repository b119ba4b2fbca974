"""Prefect's temporary server, tied to the compass process that needs it.

With no PREFECT_API_URL, Prefect starts a temporary API server (a uvicorn subprocess) on first use and stops it
at exit through atexit, which a SIGKILL never reaches: the server outlived the run and kept its port and
database. Prefect keeps one such server per process (SubprocessASGIServer is a singleton keyed by port); compass
creates that singleton itself, from the main thread, with a launch that arms the parent-death signal in the
child, so every later Prefect call finds it running and the kernel stops it when compass ends, however it ends.
The main thread is the one that forks because the signal fires when the forking thread exits.
"""

from __future__ import annotations

import os
import subprocess
import threading
from functools import partial
from types import SimpleNamespace
from typing import Any


def start_tied_temporary_server() -> Any | None:
    """Start the temporary server now, tied to this process; None when a server is configured (PREFECT_API_URL)
    or one already runs. Call from the main thread before any flow runs."""
    if os.environ.get("PREFECT_API_URL"):
        return None
    if threading.current_thread() is not threading.main_thread():
        raise RuntimeError("the temporary Prefect server must be started from the main thread")
    from prefect.server.api import server as prefect_server

    from compass.infra.die_with_parent import parent_death_preexec
    from compass.infra.environment import SERVER_STARTUP_S

    existing = prefect_server.SubprocessASGIServer._instances.get(None)
    if existing is not None:
        if existing.running:
            return None
        del prefect_server.SubprocessASGIServer._instances[None]  # made, never started: ours replaces it
    die_with_parent = parent_death_preexec()

    class TiedServer(prefect_server.SubprocessASGIServer):
        def _run_uvicorn_command(self) -> subprocess.Popen[Any]:
            tied = SimpleNamespace(**{**vars(subprocess), "Popen": partial(subprocess.Popen,
                                                                          preexec_fn=die_with_parent)})
            prefect_server.subprocess = tied  # only Prefect's server module sees the tied launch, only now
            try:
                return super()._run_uvicorn_command()
            finally:
                prefect_server.subprocess = subprocess

    server = TiedServer()  # registers itself as the process's one temporary server
    # explicit: Prefect reads its own setting from the settings it loaded when first imported
    server.start(timeout=int(os.environ.get("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", SERVER_STARTUP_S)))
    return server
