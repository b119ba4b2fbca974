"""Process environment compass needs, set before Prefect, Ray or Hugging Face libraries are imported."""

from __future__ import annotations

import os
from pathlib import Path

from compass.specs.file_stamp import hub_cache

__all__ = ["OFFLINE", "SERVER_STARTUP_S", "hub_cache", "prepare_environment"]

OFFLINE = {
    "HF_HUB_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "HF_HUB_DISABLE_TELEMETRY": "1",
    "DO_NOT_TRACK": "1",
    "RAY_USAGE_STATS_ENABLED": "0",
    "TOKENIZERS_PARALLELISM": "false",
}


# Prefect's temporary server gets this long to answer (Prefect's default, 20, is counted in 0.1-s polls and ran out
# on a busy 2-core machine while the server migrated its database).
SERVER_STARTUP_S = 180


def prepare_environment(home: Path | None = None) -> None:
    """Offline Hugging Face, quiet telemetry, and a project-local Prefect home; never overrides the user."""
    for key, value in OFFLINE.items():
        os.environ.setdefault(key, value)
    base = home or Path.cwd() / ".compass"
    if "PREFECT_HOME" not in os.environ:  # its database holds every spec's text: readable by this user only
        private = base / "prefect"
        private.mkdir(parents=True, exist_ok=True)
        private.chmod(0o700)
        os.environ["PREFECT_HOME"] = str(private)
    Path(os.environ["PREFECT_HOME"]).mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", str(SERVER_STARTUP_S))
    os.environ.setdefault("PREFECT_LOGGING_LOG_PRINTS", "true")
    os.environ.setdefault("PREFECT_LOGGING_EXTRA_LOGGERS", "compass")  # training progress in the run's logs
    os.environ.setdefault("PREFECT_RESULTS_PERSIST_BY_DEFAULT", "false")
    os.environ.setdefault("PREFECT_SERVER_DATABASE_TIMEOUT", "60")  # SQLite contention under parallel tasks
