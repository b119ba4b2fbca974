"""The database behind `compass server`: SQLite in the Prefect home by default (one user), PostgreSQL for a team's
shared server (Prefect's guidance for concurrent runs over weeks). Checked before the server starts, so a wrong URL
or an unreachable database is one clear line, not a migration traceback."""

from __future__ import annotations

import asyncio
from urllib.parse import urlsplit, urlunsplit

PG, LITE = "postgresql+asyncpg", "sqlite+aiosqlite"
DRIVERS = {"postgresql": PG, "postgres": PG, PG: PG, "sqlite": LITE, LITE: LITE}
EXAMPLE = "postgresql://prefect:PASSWORD@db-host:5432/prefect"


class DatabaseError(ValueError):
    """A --database the server cannot use, with the fix."""


def prefect_database_url(given: str) -> str:
    """The SQLAlchemy URL Prefect's server takes (PREFECT_API_DATABASE_CONNECTION_URL) for a user's URL."""
    scheme, sep, rest = given.partition("://")
    if not sep or scheme not in DRIVERS:
        raise DatabaseError(f"--database {redacted(given)!r} is not a PostgreSQL (or SQLite) URL: give {EXAMPLE}")
    if DRIVERS[scheme].startswith("postgresql"):
        parts = urlsplit(given)
        if not parts.hostname or not parts.path.strip("/"):
            raise DatabaseError(f"--database {redacted(given)!r} names no host or no database: give {EXAMPLE}")
    return f"{DRIVERS[scheme]}://{rest}"


def redacted(url: str) -> str:
    """The URL with its password hidden (it goes to logs and messages)."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.replace(f":{parts.password}@", ":***@", 1)
    return urlunsplit(parts._replace(netloc=netloc))


def unreachable(url: str, timeout_s: float = 10) -> str | None:
    """Why the server could not use the PostgreSQL database at `url` (None: it answers and takes this login)."""
    if not url.startswith("postgresql"):
        return None
    import asyncpg

    async def probe() -> None:
        connection = await asyncpg.connect(url.replace("postgresql+asyncpg://", "postgresql://", 1), timeout=timeout_s)
        await connection.close()

    try:
        asyncio.run(probe())
    except (TimeoutError, OSError, asyncpg.PostgresError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return None
