"""Loopback helpers: a free port for a server or a rendezvous, and waiting until a server answers."""

from __future__ import annotations

import socket
import subprocess
import time
import urllib.error
import urllib.request


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for_http(url: str, proc: subprocess.Popen | None = None, timeout: float = 180.0) -> None:
    """Return once `url` answers with any HTTP status (401 counts: the server is up); RuntimeError when `proc`
    exits first or `timeout` seconds pass."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(url, timeout=2):
                return
        except urllib.error.HTTPError:
            return
        except OSError:
            pass
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{url}: the server exited with {proc.returncode} before answering")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{url}: no answer within {timeout:.0f}s")
        time.sleep(0.5)
