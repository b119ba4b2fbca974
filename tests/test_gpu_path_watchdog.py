"""A hung collective is found in seconds, not at the "no step for 10 minutes" alert: each rank's watchdog names
its rank and node, dumps every thread's stack (the waiting rank's shows the collective), and exits non-zero so the
job is retried. Two gloo ranks run tests/hang_ranks.py; on NCCL the same thread watches the same steps."""

from __future__ import annotations

import socket
import subprocess
import sys

from tests.conftest import REPO


def test_a_rank_stuck_in_a_collective_dumps_its_stacks_names_itself_and_exits():
    from compass.infra.net import free_port
    from compass.model.training.watchdog import HUNG_EXIT_CODE

    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                           "--master_port", str(free_port()), "-m", "tests.hang_ranks", "2"],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    node = socket.gethostname()
    assert f"compass hang watchdog: rank 0 on node {node} (stage stage1, step 2): no step ended for 2 s" in out, out
    waiting = out[out.index("rank 0 on node"):]
    assert "in all_reduce" in waiting and "collectives.py" in waiting  # where rank 0 waits: the collective
    assert f"exitcode  : {HUNG_EXIT_CODE}" in out  # torchrun's report of the rank the watchdog ended
