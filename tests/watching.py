"""What a test observes while the code under test works: a sample taken on a thread of its own every few
milliseconds for as long as a `with` block runs (disk use, Slurm's queue, service-discovery files)."""

from __future__ import annotations

import threading
from typing import Self


class Watch:
    """Calls `sample()` every `every_s` seconds while the `with` block runs; subclasses keep what they saw."""

    every_s = 0.2

    def __init__(self) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def sample(self) -> None:
        raise NotImplementedError

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.every_s)

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join()
