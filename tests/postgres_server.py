"""A PostgreSQL cluster of the test's own on loopback: `initdb` in a temp folder, `pg_ctl start` on a free port,
stopped by the postmaster's PID. PostgreSQL refuses to run as root: when the tests run as root the cluster runs as
the `postgres` user that Debian's package creates (infra/setup.sh installs it)."""

from __future__ import annotations

import os
import pwd
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

from compass.infra.net import free_port

USER, PASSWORD, DATABASE = "compass", "a-test-only-passphrase", "prefect"


def pg_bin(name: str) -> str:
    """A PostgreSQL program: on PATH, else Debian's newest /usr/lib/postgresql/<version>/bin. Fails (never skips)
    with the set-up command where PostgreSQL is missing."""
    found = shutil.which(name) or next(
        (str(p) for p in sorted(Path("/usr/lib/postgresql").glob(f"*/bin/{name}"), reverse=True)), None)
    if found is None:
        pytest.fail(f"PostgreSQL's {name} is not installed: run `bash infra/setup.sh` as root", pytrace=False)
    return found


@dataclass(frozen=True)
class Postgres:
    port: int
    folder: Path

    @property
    def url(self) -> str:
        return f"postgresql://{USER}:{PASSWORD}@127.0.0.1:{self.port}/{DATABASE}"


def _as_owner(argv: list[str]) -> list[str]:
    return ["runuser", "-u", "postgres", "--", *argv] if os.geteuid() == 0 else argv


@contextmanager
def postgres_cluster() -> Iterator[Postgres]:
    folder = Path(tempfile.mkdtemp(prefix="compass-pg-"))  # not under pytest's root-only temp folder
    data, port = folder / "data", free_port()
    (folder / "password").write_text(PASSWORD + "\n")
    if os.geteuid() == 0:
        owner = pwd.getpwnam("postgres")
        os.chown(folder, owner.pw_uid, owner.pw_gid)
        os.chown(folder / "password", owner.pw_uid, owner.pw_gid)
    subprocess.run(_as_owner([pg_bin("initdb"), "-D", str(data), "-U", USER, "--pwfile", str(folder / "password"),
                              "--auth-local=trust", "--auth-host=scram-sha-256", "-E", "UTF8", "--no-sync"]),
                   check=True, capture_output=True)
    subprocess.run(_as_owner([pg_bin("pg_ctl"), "-D", str(data), "-l", str(folder / "server.log"), "-w", "-t", "120",
                              "-o", f"-h 127.0.0.1 -p {port} -k {folder}", "start"]), check=True,
                   capture_output=True)
    try:
        subprocess.run([pg_bin("createdb"), "-h", "127.0.0.1", "-p", str(port), "-U", USER, DATABASE], check=True,
                       capture_output=True, env={**os.environ, "PGPASSWORD": PASSWORD})
        yield Postgres(port, folder)
    finally:
        _stop(data)
        shutil.rmtree(folder, ignore_errors=True)


def _stop(data: Path) -> None:
    """SIGINT to the postmaster (PostgreSQL's fast shutdown), SIGKILL if it lingers."""
    try:
        pid = int((data / "postmaster.pid").read_text().split()[0])
    except (FileNotFoundError, ValueError, IndexError):
        return
    os.kill(pid, signal.SIGINT)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.2)
    os.kill(pid, signal.SIGKILL)
