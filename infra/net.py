"""Loopback helpers: a free port for a server or a rendezvous, and waiting until a server answers."""

from __future__ import annotations

import random
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

LOWEST = 20000  # below the kernel's ephemeral range (32768 by default), above the well-known services
_draw = random.SystemRandom()  # not the global generator: runs seed it, and two seeded processes would collide


def free_port() -> int:
    """A port free now, for a server or a rendezvous that binds it a moment later. Chosen below the kernel's
    ephemeral range: a port the kernel handed out (bind to 0) is the one it hands out next to any process's
    outgoing connection or bind, and a torchrun rendezvous lost it that way (EADDRINUSE) under load."""
    first_ephemeral = first_ephemeral_port()
    for _ in range(100):
        port = _draw.randrange(LOWEST, first_ephemeral) if first_ephemeral > LOWEST + 1000 else 0
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return s.getsockname()[1]
    raise OSError(f"no free port in {LOWEST}-{first_ephemeral - 1}")


def first_ephemeral_port() -> int:
    """The lowest port the kernel hands out on its own (bind to 0, outgoing connections)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


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
