"""The hang watchdog: a training rank whose step has not ended within `how.monitoring.hang_timeout_s` dumps every
thread's stack to its log, naming its rank and node, and exits with HUNG_EXIT_CODE.

A collective waiting on a stuck or dead peer blocks every rank silently: NCCL's own timeout (30 minutes under
DeepSpeed) aborts without saying where each rank stood, and teams have lost days to it. The stacks say which rank
waits in which collective and what the stuck one is doing; the non-zero exit fails the job, so Slurm's requeue or
the step's retries resume it from its newest checkpoint. A thread of its own does the waiting (a rank blocked in
C++ still lets Python threads run), re-armed after every step; the first step gets FIRST_STEP_ALLOWANCE times the
timeout (compilation, the rank check, the first collectives' set-up). With several ranks it first writes one
located line from the collective ledger (model/training/collective_ledger.py): the collective it waits in, by
number, and each rank that has not entered it, frozen or alive; and it beats in that ledger every second.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import socket
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

from compass.infra.exits import RETRIABLE_EXIT, mark_retriable
from compass.model.training import collectives
from compass.model.training.callbacks import Callback
from compass.model.training.collective_ledger import missing_peers, read_ledger
from compass.model.training.loop_view import TrainingLoop

if TYPE_CHECKING:
    from compass.model.training.records import MetricsRow

HUNG_EXIT_CODE = RETRIABLE_EXIT  # a retry may well succeed
FIRST_STEP_ALLOWANCE = 3


def process_group_timeout_s(hang_timeout_s: float) -> float:
    """How long the backend lets a collective wait: past the watchdog's longest allowance, so the watchdog (with
    every thread's stack) fires first."""
    return hang_timeout_s * (FIRST_STEP_ALLOWANCE + 1)


class HangWatchdog(Callback):
    def __init__(self, timeout_s: float, out: TextIO | None = None, workdir: Path | None = None):
        """`workdir`: where the firing rank says its exit is retriable (infra/exits.py)."""
        self.timeout_s = timeout_s
        self.out = out or sys.stderr
        self.deadline = float("inf")
        self.where = ""
        self.workdir = workdir
        self.rank = 0
        self.stopped = threading.Event()
        self.thread: threading.Thread | None = None

    def on_start(self, trainer: TrainingLoop) -> None:
        self._arm(trainer, self.timeout_s * FIRST_STEP_ALLOWANCE)
        self.thread = threading.Thread(target=self._watch, name="compass-hang-watchdog", daemon=True)
        self.thread.start()

    def post_step(self, trainer: TrainingLoop, row: MetricsRow) -> None:
        self._arm(trainer, self.timeout_s)

    def post_restore(self, trainer: TrainingLoop, step: int) -> None:
        self._arm(trainer, self.timeout_s * FIRST_STEP_ALLOWANCE)

    def on_error(self, trainer: TrainingLoop, exc: BaseException) -> None:
        self.stopped.set()

    def on_end(self, trainer: TrainingLoop) -> None:
        self.stopped.set()

    def _arm(self, trainer: TrainingLoop, seconds: float) -> None:
        ledger = collectives.ledger()
        if ledger is not None:
            ledger.at_step(trainer.global_step + 1)
        self.rank = trainer.rank
        self.where = (f"rank {trainer.rank} on node {socket.gethostname()} (stage {trainer.stage.name}, step "
                      f"{trainer.global_step + 1})")
        self.deadline = time.monotonic() + seconds

    def _watch(self) -> None:
        while not self.stopped.wait(min(1.0, max(0.0, self.deadline - time.monotonic()))):
            ledger = collectives.ledger()
            if ledger is not None:
                with contextlib.suppress(OSError):  # a beat lost: never the watchdog itself
                    ledger.beat()  # this process's threads still run, whatever its training thread waits on
            if time.monotonic() >= self.deadline:
                self.fire()

    def located(self) -> str | None:
        """The collective this rank waits in and the ranks that did not join it (None without a ledger)."""
        ledger = collectives.ledger()
        if ledger is None:
            return None
        try:
            peers = read_ledger(ledger.folder, ledger.entry.launch)
            return missing_peers(ledger.entry, collectives.world_size(), peers, time.time())
        except Exception as exc:  # the line is a help: the stacks and the exit must follow whatever happens here
            return f"{self.where}: the collective ledger could not be read ({exc})"

    def fire(self) -> None:
        """Say where this rank stands, dump every thread's stack, and end the process (no cleanup: it may hang)."""
        located = self.located()
        if located is not None:
            print(f"compass hang: {located}", file=self.out, flush=True)
        print(f"compass hang watchdog: {self.where}: no step ended for {self.timeout_s:g} s "
              "(how.monitoring.hang_timeout_s); a rank waiting in a collective means a peer is stuck or dead. "
              "Every thread's stack follows; the job exits for a retry from its newest checkpoint.",
              file=self.out, flush=True)
        faulthandler.dump_traceback(file=self.out, all_threads=True)
        self.out.flush()
        if self.workdir is not None:
            with contextlib.suppress(OSError):  # the exit code still says it
                mark_retriable(self.workdir, self.rank, "hang watchdog: " + (
                    located or f"{self.where}: no step ended for {self.timeout_s:g} s"))
        os._exit(HUNG_EXIT_CODE)
