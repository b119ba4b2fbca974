"""Object-store credentials from a Prefect Secret block, for workers whose environment holds none.

The block's JSON value becomes the standard AWS variables of the flow's process before any store is opened,
so s3fs, datatrove and every child process (torchrun ranks, lighteval) find them the usual way. The values
are never logged, and manifests only ever record URIs.
"""

from __future__ import annotations

import os
from typing import Any

BLOCK_KEYS = {
    "aws_access_key_id": "AWS_ACCESS_KEY_ID",
    "aws_secret_access_key": "AWS_SECRET_ACCESS_KEY",
    "aws_session_token": "AWS_SESSION_TOKEN",
    "endpoint_url": "AWS_ENDPOINT_URL",
    "region_name": "AWS_DEFAULT_REGION",
}


class CredentialsBlockError(ValueError):
    pass


def credentials_env(value: Any, block: str) -> dict[str, str]:
    """The environment variables a Secret block's value stands for."""
    if not isinstance(value, dict):
        raise CredentialsBlockError(f"Secret block '{block}' must hold a JSON object with keys "
                                    f"{', '.join(BLOCK_KEYS)}")
    unknown = sorted(set(value) - set(BLOCK_KEYS))
    if unknown:
        raise CredentialsBlockError(f"Secret block '{block}' has unknown keys {', '.join(unknown)}; "
                                    f"allowed: {', '.join(BLOCK_KEYS)}")
    return {BLOCK_KEYS[k]: str(v) for k, v in value.items() if v not in (None, "")}


def apply_credentials_block(block: str | None) -> list[str]:
    """Load the named Secret block into this process's environment; returns the variable names set."""
    if not block:
        return []
    from prefect.blocks.system import Secret

    try:
        value = Secret.load(block).get()
    except ValueError as exc:
        raise CredentialsBlockError(f"how.storage.credentials_block: no Secret block named '{block}' on the "
                                    f"Prefect server ({exc.__class__.__name__})") from None
    env = credentials_env(value, block)
    os.environ.update(env)
    return sorted(env)
