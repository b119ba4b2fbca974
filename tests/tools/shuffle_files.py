"""A pytest plugin that runs the suite's files in a shuffled order (each file's tests stay together, in their own
order): `-p tests.tools.shuffle_files` with COMPASS_SHUFFLE_SEED set. A file that passes only after another file set
something up in the same worker fails here. Not part of `make test`; tests/tools/isolation.py uses it."""

from __future__ import annotations

import os
import random

import pytest

SEED_VARIABLE = "COMPASS_SHUFFLE_SEED"


@pytest.hookimpl(trylast=True)  # after tests/scheduling.py's longest-first sort, which it replaces
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    seed = os.environ.get(SEED_VARIABLE)
    if seed is None:
        return
    files = list(dict.fromkeys(item.path for item in items))
    random.Random(int(seed)).shuffle(files)  # the same order in every xdist worker: they must collect alike
    rank = {path: i for i, path in enumerate(files)}
    items.sort(key=lambda item: rank[item.path])


def pytest_report_header() -> str | None:
    seed = os.environ.get(SEED_VARIABLE)
    return f"files shuffled with seed {seed} ({SEED_VARIABLE})" if seed is not None else None
