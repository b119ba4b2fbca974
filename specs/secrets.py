"""Secrets in text: a URL's password (however it is written: unencoded `/`, `#` or `@` included) and query-string
credentials (`?password=`, `token=`, ...). Validation refuses them in a spec (specs/checks.py); everything compass
prints or logs goes through `redact` (infra/redact.py)."""

from __future__ import annotations

import re

# scheme://user:password@host...: the password runs to the last '@' before the host (it may hold '/', '#', ':')
_USERINFO = re.compile(r"(?P<head>\b[a-zA-Z][a-zA-Z0-9+.-]*://[^\s:/@]*:)(?P<secret>[^\s]*)@(?P<host>[^\s@/?#]*)")
_QUERY = re.compile(r"(?P<head>[?&;](?:password|passwd|pwd|token|secret|access_token|api_key|apikey|key)=)"
                    r"(?P<secret>[^&;\s#]*)", re.IGNORECASE)


def redact(text: str) -> str:
    """`text` with every URL password and query-string credential replaced by ***."""
    text = _USERINFO.sub(lambda m: f"{m['head']}***@{m['host']}", text)
    return _QUERY.sub(lambda m: f"{m['head']}***", text)
