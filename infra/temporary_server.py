"""Prefect's temporary server, tied to the compass process that needs it.

With no PREFECT_API_URL, Prefect starts a temporary API server (a uvicorn subprocess) on first use and stops it
at exit through atexit, which a SIGKILL never reaches: the server outlived the run and kept its port and
database. compass starts that server itself, from the main thread, with the same command and environment Prefect
uses, with the parent-death signal armed in the child so the kernel stops it when compass ends, however it ends
(the signal fires when the forking thread exits, hence the main thread). It then points Prefect at it through
PREFECT_API_URL: every later Prefect call is a plain client of a running server, and the run's process never
imports Prefect's server package (~2.5 s of CPU at every `compass run` when it went through Prefect's own
launcher).
"""

from __future__ import annotations

import atexit
import errno
import os
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from compass.infra.die_with_parent import parent_death_preexec
from compass.infra.disk_full import FULL, full_disk_of, nearly_full
from compass.infra.environment import SERVER_STARTUP_S
from compass.infra.errors import DiskFull
from compass.infra.net import free_port

PORT_TAKEN = 3  # uvicorn's exit status when its port is bound by someone else between our check and its bind


@dataclass
class TemporaryServer:
    """A running temporary server: its process and the API URL Prefect now uses."""

    process: subprocess.Popen[bytes]
    api_url: str

    def stop(self) -> None:
        """SIGTERM, so the server closes its database; SIGKILL if it does not end within 5 s."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


_running: TemporaryServer | None = None


def temporary_server_running() -> bool:
    """Whether this process serves its own flows (its PREFECT_API_URL ends with it: no page to link to after)."""
    return _running is not None


def start_tied_temporary_server() -> TemporaryServer | None:
    """Start the temporary server now, tied to this process, and make it PREFECT_API_URL; None when a server is
    configured or one already runs. Call from the main thread before any flow runs."""
    global _running
    if os.environ.get("PREFECT_API_URL") or _running is not None:
        return None
    if threading.current_thread() is not threading.main_thread():
        raise RuntimeError("the temporary Prefect server must be started from the main thread")

    timeout = float(os.environ.get("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", SERVER_STARTUP_S))
    home = _prefect_home()
    _refuse_full_home(home)
    try:
        server = _launch(timeout)
    except RuntimeError:
        _refuse_full_home(home)  # filled while it started: the disk is why, not the wait
        raise
    atexit.register(server.stop)
    os.environ["PREFECT_API_URL"] = server.api_url  # the run's own children see the same server
    from prefect.context import refresh_global_settings_context

    refresh_global_settings_context()  # Prefect read its settings when first imported: read them again
    _running = server
    return server


def _prefect_home() -> Path:
    from prefect.settings import get_current_settings

    return Path(get_current_settings().home).expanduser()


def _refuse_full_home(home: Path) -> None:
    """DiskFull, naming the folder and what is free there, when Prefect's home cannot take its database's writes:
    the server would otherwise never answer, and the run would wait out the start-up timeout to blame it."""
    probe_at = next((p for p in [home, *home.parents] if p.exists()), Path("/"))
    code = errno.ENOSPC if nearly_full(home) else None
    if code is None and home.is_dir():
        probe = home / f".compass-write-probe-{os.getpid()}"
        try:
            with open(probe, "wb") as out:
                out.write(b"\0" * 4096)  # a page: what a quota or a size limit refuses first
                out.flush()
                os.fsync(out.fileno())
        except OSError as exc:
            full = full_disk_of(exc)
            code = full.code if full is not None else None
            if code is None:
                raise
        finally:
            probe.unlink(missing_ok=True)
    if code is not None:
        free = shutil.disk_usage(probe_at).free / 2**20
        raise DiskFull(code, f"Prefect's home {home}: {FULL[code]} it ({free:,.1f} MiB free there): its database "
                             "cannot be written, so its server would never answer. Free space there, or set "
                             "PREFECT_HOME to a folder on a larger disk")


def _launch(timeout: float) -> TemporaryServer:
    """The uvicorn process serving Prefect's API on a free loopback port, once it answers its health check."""
    import httpx


    deadline = time.monotonic() + timeout
    while True:
        port = free_port()
        process = subprocess.Popen(_command(port), env=_environment(), preexec_fn=parent_death_preexec())
        api_url = f"http://127.0.0.1:{port}/api"
        with httpx.Client() as client:
            while process.poll() is None:
                try:
                    if client.get(f"{api_url}/health", timeout=5).status_code == 200:
                        return TemporaryServer(process, api_url)
                except httpx.TransportError:
                    pass
                if time.monotonic() > deadline:
                    TemporaryServer(process, api_url).stop()
                    raise RuntimeError(f"Prefect's temporary server did not answer on {api_url} within "
                                       f"{timeout:.0f} s (PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS)")
                time.sleep(0.1)
        if process.returncode != PORT_TAKEN or time.monotonic() > deadline:
            raise RuntimeError(f"Prefect's temporary server exited with status {process.returncode} before it "
                               f"answered (its output is above)")


def _command(port: int) -> list[str]:
    """Prefect's own command for its temporary server (prefect.server.api.server.SubprocessASGIServer)."""
    import prefect

    return [sys.executable, "-m", "uvicorn", "--app-dir", str(prefect.__module_path__.parent), "--factory",
            "prefect.server.api.server:create_app", "--host", "127.0.0.1", "--port", str(port), "--log-level",
            "error", "--lifespan", "on"]


def _environment() -> dict[str, str]:
    """Prefect's environment for its temporary server: no UI, marked ephemeral, with this process's settings."""
    from prefect.settings import get_current_settings

    return {**os.environ, "PREFECT_UI_ENABLED": "0", "PREFECT__SERVER_EPHEMERAL": "1", "PREFECT__SERVER_FINAL": "1",
            **get_current_settings().to_environment_variables(exclude_unset=True)}


