"""A hung collective is found in seconds, not at the "no step for 10 minutes" alert: each rank's watchdog names
its rank and node, dumps every thread's stack (the waiting rank's shows the collective), and exits non-zero so the
job is retried; with a collective ledger, rank 0 also names the rank that did not join. Gloo ranks run
tests/hang_ranks.py; on NCCL the same thread watches the same steps."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

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


@pytest.mark.slow  # torchrun gives the frozen rank its 30 s to end on SIGTERM before it kills it
def test_the_watchdog_names_the_rank_that_did_not_join_frozen_or_alive(tmp_path):
    """Three ranks; the third stops after step 1, frozen (SIGSTOP, as on a lost node) or alive elsewhere (asleep).
    Rank 0's watchdog names the collective it waits in by number and the one rank that has not entered it, with
    whether its threads still run, in one line, before the stacks (issue 47, item 3)."""
    from compass.infra.net import free_port
    from compass.model.training.watchdog import HUNG_EXIT_CODE

    node = socket.gethostname()
    for how, state in (("freeze", "frozen or gone: no heartbeat for"), ("sleep", "alive, not joining")):
        ledger = tmp_path / how
        proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "3",
                               "--master_port", str(free_port()), "-m", "tests.hang_ranks", "6", str(ledger), how],
                              cwd=REPO, capture_output=True, text=True, timeout=300)
        out = proc.stdout + proc.stderr
        assert f"exitcode  : {HUNG_EXIT_CODE}" in out, out
        (line,) = [s for s in out.splitlines() if s.startswith("compass hang: ")]
        assert line.startswith(f"compass hang: rank 0 on node {node} waits in collective #2 (all_reduce) of step 2; "
                               f"not joined: rank 2 on node {node} (in step 2, last in collective #1 (all_reduce) of "
                               "step 1; "), line
        assert state in line and "rank 1 " not in line, line  # rank 1 waits in the same collective


def test_when_every_rank_entered_the_collective_the_frozen_one_is_named():
    """A rank stopped inside an engine's own collective (DeepSpeed's gradient reduction) entered compass's last
    collective like the others: the line says so and names the rank whose heartbeat stopped."""
    from compass.model.training.collective_ledger import LedgerEntry, missing_peers

    now = 1000.0
    entries = {r: LedgerEntry(rank=r, node=f"n{r}", step=17, seq=28, collective="all_reduce", collective_step=17,
                              heartbeat=now - (20 if r == 1 else 0.5)) for r in range(3)}
    line = missing_peers(entries[0], 3, entries, now)
    assert line == ("rank 0 on node n0 waits in collective #28 (all_reduce) of step 17; every rank entered it: the "
                    "stall is inside it or in a collective of the engine's own; frozen or gone: rank 1 on node n1 "
                    "(in step 17; no heartbeat for 20 s)")
    assert "frozen" not in missing_peers(entries[0], 3, {**entries, 1: entries[2]}, now)


def test_records_left_by_an_earlier_launch_are_not_read(tmp_path, monkeypatch):
    """A resumed job's ranks share the work folder with the records their killed predecessors left: a rank slow to
    start must read as having no record, not as the earlier launch's rank that stood far ahead."""
    from compass.model.training.collective_ledger import CollectiveLedger, read_ledger, this_launch

    monkeypatch.setenv("MASTER_PORT", "29500")
    earlier = CollectiveLedger(tmp_path, 1, "n1")
    for _ in range(40):
        earlier.enter("all_reduce")
    monkeypatch.setenv("MASTER_PORT", "29501")  # the resumed launch
    CollectiveLedger(tmp_path, 0, "n0").enter("all_reduce")
    assert set(read_ledger(tmp_path, this_launch())) == {0}
    monkeypatch.setenv("MASTER_PORT", "29500")
    assert read_ledger(tmp_path, this_launch())[1].seq == 40


LOST_PEER = """
import os, sys, time
import torch
from compass.model.training import collectives
collectives.init("gloo", timeout_s=120)
rank = collectives.rank_env()[0]
collectives.all_reduce(torch.ones(1))
if rank == 1:
    os._exit(9)  # lost: its connections close
time.sleep(1)
try:
    collectives.all_reduce(torch.ones(1))
except Exception as failed:
    print("broken collective:", collectives.broke_a_collective(failed), type(failed).__name__, flush=True)
print("a bug:", collectives.broke_a_collective(RuntimeError("shape mismatch")), flush=True)
os._exit(0)
"""


def test_a_peer_lost_under_gloo_is_a_broken_collective_a_retry_may_cure(tmp_path):
    """gloo's error for a lost peer reaches Python as a plain RuntimeError, not torch's DistError: the ranks
    (trainer, TRL, lighteval) tell it from a bug by its source (collectives.broke_a_collective), exit retriable and
    their Slurm job requeues itself. Before, only DistError (NCCL's) counted, so on gloo a lost peer failed the job."""
    from compass.infra.net import free_port

    script = tmp_path / "lost_peer.py"
    script.write_text(LOST_PEER)
    rendezvous = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": "2"}
    ranks = [subprocess.Popen([sys.executable, str(script)], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, env={**os.environ, **rendezvous, "RANK": str(rank), "LOCAL_RANK": str(rank)})
             for rank in (0, 1)]  # not torchrun: it would stop rank 0 as soon as rank 1 is gone
    out = ranks[0].communicate(timeout=300)[0]
    ranks[1].wait(60)
    assert "broken collective: True RuntimeError" in out, out[-4000:]
    assert "a bug: False" in out, out[-4000:]
