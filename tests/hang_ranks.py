"""Two ranks, one of which gets stuck after the first step while the other waits for it in a collective, each
under compass's hang watchdog: `torchrun --nproc_per_node 2 -m tests.hang_ranks TIMEOUT_S`
(tests/test_gpu_path_watchdog.py). The trainer is reduced to what the watchdog reads of it."""

from __future__ import annotations

import sys
import time
from types import SimpleNamespace

import torch

from compass.model.training import collectives
from compass.model.training.watchdog import HangWatchdog


def main() -> None:
    collectives.init("gloo", timeout_s=600)
    rank = collectives.rank_env()[0]
    trainer = SimpleNamespace(rank=rank, stage=SimpleNamespace(name="stage1"), global_step=0)
    # the stuck rank's own watchdog fires later: had it fired first, torchrun would stop rank 0 mid-dump
    watchdog = HangWatchdog(timeout_s=float(sys.argv[1]) * (1 if rank == 0 else 30))
    watchdog.on_start(trainer)
    collectives.all_reduce(torch.ones(1))  # step 1, on both ranks
    trainer.global_step = 1
    watchdog.post_step(trainer, None)
    if rank == 1:
        time.sleep(600)  # stuck: never reaches the next collective
    collectives.all_reduce(torch.ones(1))  # rank 0 waits here for its peer


if __name__ == "__main__":
    main()
