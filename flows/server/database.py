"""The database behind `compass server`: SQLite in the Prefect home by default (one user), PostgreSQL for a team's
shared server (Prefect's guidance for concurrent runs over weeks). Checked before the server starts, so a wrong URL
or an unreachable database is one clear line, not a migration traceback."""

from __future__ import annotations

import asyncio

from compass.infra.redact import redact

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
        try:
            from sqlalchemy.engine import make_url  # the parser the server itself reads the URL with

            parsed = make_url(given.replace(scheme, "postgresql", 1))
            host, database = parsed.host, parsed.database
        except Exception:  # noqa: BLE001 - any parse failure is the user's URL: say so without echoing it
            host = database = None
        if not host or not database:
            raise DatabaseError(f"--database {redacted(given)!r} names no host or no database, or a character in it "
                                f"must be percent-encoded (a '/', '#' or '@' in the password: %2F, %23, %40): give "
                                f"{EXAMPLE}")
    return f"{DRIVERS[scheme]}://{rest}"


def redacted(url: str) -> str:
    """The URL with its password hidden, however it is written (it goes to logs and messages)."""
    return redact(url)


def unreachable(url: str, timeout_s: float = 10) -> str | None:
    """Why the server could not use the PostgreSQL database at `url` (None: it answers and takes this login)."""
    if not url.startswith("postgresql"):
        return None
    import asyncpg  # deferred: only a PostgreSQL server needs it (40 ms of every `compass` command otherwise)

    async def probe() -> None:
        connection = await asyncpg.connect(url.replace("postgresql+asyncpg://", "postgresql://", 1), timeout=timeout_s)
        await connection.close()

    try:
        asyncio.run(probe())
    except (TimeoutError, OSError, ValueError, asyncpg.PostgresError) as exc:
        return redact(f"{type(exc).__name__}: {exc}")
    return None
