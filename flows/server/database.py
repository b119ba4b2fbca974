"""The database behind `compass server`: SQLite in the Prefect home by default (one user), PostgreSQL for a team's
shared server (Prefect's guidance for concurrent runs over weeks). Checked before the server starts, so a wrong URL
or an unreachable database is one clear line, not a migration traceback."""

from __future__ import annotations

import asyncio
import os
from urllib.parse import quote, unquote, urlsplit

from compass.infra.redact import redact
from compass.specs.how import system_folder_problem

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
        rest = _encoded_login(rest)
        given = f"{scheme}://{rest}"
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
    elif problem := _database_folder_problem(rest):
        raise DatabaseError(f"--database {redacted(given)!r}: {problem}")
    return f"{DRIVERS[scheme]}://{rest}"


def _database_folder_problem(rest: str) -> str | None:
    """Why SQLite may not write its file where a `sqlite:///...` URL puts it (never in a system folder, by any form):
    `sqlite:///x.db` is relative, `sqlite:////x.db` absolute."""
    path = rest.split("?", 1)[0]
    if not path.startswith("/") or path in ("/", "/:memory:"):
        return None
    folder = os.path.dirname(path[1:]) or "."
    return system_folder_problem(folder, "the server's SQLite database would be written there")


def _encoded_login(rest: str) -> str:
    """`user:password@host...` with the login percent-encoded, so a password holding '/', '#', ':' or '@' (the
    login runs to the last '@' before the host, as redact reads it) reaches the server whole; one already encoded
    stays as it is."""
    if "@" not in rest:
        return rest
    login, host = rest.rsplit("@", 1)
    user, colon, password = login.partition(":")
    return f"{quote(unquote(user), safe='')}{colon}{quote(unquote(password), safe='')}@{host}"


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

    where = _where(url)
    try:
        asyncio.run(probe())
    except asyncpg.InvalidPasswordError:
        return f"{where} refused the login (user or password)"
    except asyncpg.InvalidCatalogNameError:
        return f"{where} has no such database (create it first: createdb)"
    except (TimeoutError, OSError) as exc:
        reason = getattr(exc, "strerror", None)
        return f"{where} does not answer ({type(exc).__name__}{': ' + reason if reason else ''})"
    except (ValueError, asyncpg.PostgresError) as exc:  # said by the driver: only its kind, never its text
        return f"{where}: the driver refused the connection ({type(exc).__name__})"
    return None


def _where(url: str) -> str:
    """`PostgreSQL at host:port, database db` (no login)."""
    parsed = urlsplit(url)
    return (f"PostgreSQL at {parsed.hostname or '?'}:{parsed.port or 5432}, database "
            f"{unquote(parsed.path.lstrip('/')) or '?'}")
