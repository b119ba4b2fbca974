"""Two ranks of the trainer where a monitor's stop is decided on one rank only, as a throughput drop measured from
that rank's own timings can be: `torchrun --nproc-per-node 2 -m tests.monitor_ranks JOB OUT`. Rank 1 decides to
stop after step 3 (what callbacks.Monitoring records when its throughput monitor says stop); each rank writes what
ended its run to OUT/rank-N.json. tests/test_rehearsal_monitors.py reads them."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from compass.model.training import collectives
from compass.model.training.callbacks import Callback
from compass.model.training.job import TrainJob
from compass.model.training.monitors import Event, TrainingStopped
from compass.model.training.trainer import train_stage

DECIDED_AT = 3


class ThroughputDropOnRankOne(Callback):
    def post_step(self, trainer, row) -> None:
        if trainer.rank == 1 and trainer.global_step == DECIDED_AT and trainer.monitor_stop is None:
            trainer.monitor_stop = Event("throughput", DECIDED_AT, "stop", "120 tokens/s vs median 1,000 (rank 1)")


def main() -> None:
    job = TrainJob.model_validate_json(Path(sys.argv[1]).read_text())
    out = Path(sys.argv[2])
    rank = collectives.rank_env()[0]
    try:
        train_stage(job, [ThroughputDropOnRankOne()])
        ended = {"stopped": False}
    except TrainingStopped as stopped:
        ended = {"stopped": True, "message": str(stopped)}
    (out / f"rank-{rank}.json").write_text(json.dumps(ended))
    collectives.leave()


if __name__ == "__main__":
    main()
