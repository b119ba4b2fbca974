"""Ranks of which the last gets stuck after the first step while the others wait for it in a collective, each under
compass's hang watchdog: `torchrun --nproc_per_node N -m tests.hang_ranks TIMEOUT_S [LEDGER_FOLDER [freeze]]`
(tests/test_gpu_path_watchdog.py). The stuck rank sleeps (alive, not joining) or, with `freeze`, stops its own
process (SIGSTOP: no thread of it runs, as on a lost node). With a ledger folder the ranks number their collectives
there, as the trainer's do. The trainer is reduced to what the watchdog reads of it."""

from __future__ import annotations

import os
import signal
import socket
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

from compass.model.training import collectives
from compass.model.training.collective_ledger import CollectiveLedger
from compass.model.training.watchdog import HangWatchdog


def main() -> None:
    collectives.init("gloo", timeout_s=600)
    rank, world, _ = collectives.rank_env()
    if len(sys.argv) > 2:
        collectives.keep_ledger(CollectiveLedger(Path(sys.argv[2]), rank, socket.gethostname()))
    trainer = SimpleNamespace(rank=rank, stage=SimpleNamespace(name="stage1"), global_step=0)
    # the other ranks' watchdogs fire later: had one fired first, torchrun would stop rank 0 mid-dump
    watchdog = HangWatchdog(timeout_s=float(sys.argv[1]) * (1 if rank == 0 else 30))
    watchdog.on_start(trainer)
    collectives.all_reduce(torch.ones(1))  # step 1, on every rank
    trainer.global_step = 1
    watchdog.post_step(trainer, None)
    if rank == world - 1:
        if sys.argv[3:] == ["freeze"]:
            os.kill(os.getpid(), signal.SIGSTOP)
        time.sleep(600)  # stuck: never reaches the next collective
    collectives.all_reduce(torch.ones(1))  # the others wait here for it


if __name__ == "__main__":
    main()
