"""`compass ...` with a record, written when the process exits, of the model libraries this orchestrating process
imported: `python -m tests.watched_cli RECORD.json run SPEC ...`. Under a cluster the orchestrator only plans,
submits, follows and commits: none may appear in its record."""

from __future__ import annotations

import atexit
import json
import sys

HEAVY = ("torch", "transformers", "trl", "lighteval", "deepspeed", "peft", "datasets", "accelerate", "safetensors")


def _record(path: str) -> None:
    loaded = sorted({name.split(".")[0] for name in sys.modules if name.split(".")[0] in HEAVY})
    with open(path, "w") as f:
        json.dump({"heavy_modules": loaded}, f)


def main() -> None:
    record, *args = sys.argv[1:]
    atexit.register(_record, record)
    sys.argv = ["compass", *args]
    from compass.flows.cli.app import app

    app()


if __name__ == "__main__":
    main()
