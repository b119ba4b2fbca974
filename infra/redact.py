"""Secrets out of every message: a URL's password and query-string credentials become `***` before a URL or an
error's text is printed or logged (`redact`, specs/secrets.py), and Prefect's links are made without the login its
API URL may carry."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from urllib.parse import urlsplit, urlunsplit

from compass.specs.secrets import redact

__all__ = ["prefect_links_without_userinfo", "redact", "without_userinfo"]


def without_userinfo(url: str) -> str:
    """`url` with its `user:password@` removed (a link printed for a person: the browser asks for the login)."""
    parts = urlsplit(url)
    if "@" not in parts.netloc:
        return url
    return urlunsplit(parts._replace(netloc=parts.netloc.rsplit("@", 1)[1]))


@contextlib.contextmanager
def prefect_links_without_userinfo() -> Iterator[None]:
    """Within: Prefect's UI links (its own "View at ..." lines, stored with the flow run's logs too, and compass's
    `Prefect run:`) are made from the API URL without its login: PREFECT_API_URL=http://admin:pw@host/api printed
    the password on every run."""
    from prefect.settings import PREFECT_API_URL, PREFECT_UI_URL, temporary_settings

    ui, api = PREFECT_UI_URL.value() or "", PREFECT_API_URL.value() or ""
    if "@" not in ui and "@" not in api:
        yield
        return
    with temporary_settings({PREFECT_UI_URL: without_userinfo(ui or api.removesuffix("/api"))}):
        yield
