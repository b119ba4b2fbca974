"""A monitor that stops decides on all ranks together (N13). A throughput drop is measured from each rank's own
timings, so one rank can decide to stop while the others go on: it raised TrainingStopped alone, and the others
waited in their next collective until the hang watchdog or NCCL's timeout. The stop now rides in the next step's
loss all-reduce (no extra collective) and every rank stops before that update, with the deciding rank's reason."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from compass.infra.net import free_port
from tests.conftest import REPO

pytestmark = pytest.mark.slow


def test_a_stop_decided_on_one_rank_stops_every_rank_at_the_same_step(stage1_job, tmp_path: Path):
    job = stage1_job(tmp_path / "work", deepspeed=False, data_parallel=2, micro_batch_size=1)
    job.write(tmp_path / "job.json")
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
                           str(free_port()), "-m", "tests.monitor_ranks", str(tmp_path / "job.json"), str(tmp_path)],
                          cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    ended = [json.loads((tmp_path / f"rank-{rank}.json").read_text()) for rank in (0, 1)]
    assert all(e["stopped"] for e in ended), ended
    assert ended[0]["message"] == ended[1]["message"], ended  # the deciding rank's event, on both
    assert "throughput" in ended[0]["message"] and "(rank 1)" in ended[0]["message"]
    steps = [json.loads(line)["step"] for line in (tmp_path / "work" / "metrics.jsonl").read_text().splitlines()]
    assert steps[-1] == 3  # decided after step 3; both ranks stopped before the fourth update
