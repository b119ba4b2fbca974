"""What a rehearsal of the production launch on the emulated 2 x 2 GPU cluster must show in its stage's manifest."""

from __future__ import annotations

import re

NODES, GPUS = 2, 2


def assert_production_ranks(metrics: dict, log: str, engine: str = "deepspeed", rows: int = 4) -> None:
    """Every rank on a distinct visible GPU of its node, the engine in bf16, the start-of-run rank checks passed and
    each node staging only its own half of the step's `rows`."""
    ranks = metrics["ranks"]
    assert len(ranks) == NODES * GPUS
    by_node: dict[str, list[dict]] = {}
    for rank in ranks:
        by_node.setdefault(rank["node"], []).append(rank)
    assert sorted(by_node) == ["node1", "node2"], ranks  # Slurm's nodes, not this host's name
    for node, on_node in by_node.items():
        assert sorted(r["local_rank"] for r in on_node) == list(range(GPUS)), (node, on_node)
        assert sorted(r["gpu"] for r in on_node) == ["0", "1"], (node, on_node)  # distinct visible GPUs per node
        for rank in on_node:
            assert rank["device"] == f"cpu (would open cuda:{rank['local_rank']} (GPU {rank['gpu']}))", rank
            assert rank["visible"] == ["0", "1"], rank  # Slurm's list of the node's GPUs, not unset, not one
    setup = metrics["setup"]
    assert (setup["engine"], setup["precision"]) == (engine, "bf16"), setup
    # the recipe's numerics, read from the engine the ranks built: bf16 compute, gradients summed and reduced in fp32
    assert setup["gradients"] == "accumulated in float32, reduced in float32", setup
    # the start-of-run checks read the bf16 weights DeepSpeed holds (before: numpy has no bfloat16, a TypeError)
    assert metrics["parallel"] == ("4 ranks (2 data-parallel x 2 tensor-parallel): identical replicas, distinct data, "
                                   "distinct shards; shards gathered equal the initial weights")
    # each node stages the rows of its own ranks: node 1 the first half, node 2 the second (LOCAL_WORLD_SIZE 2)
    staged = sorted(set(re.findall(r"for rows (\d+)-(\d+) of (\d+)", log)))
    half = rows // 2
    assert staged == [("0", str(half - 1), str(rows)), (str(half), str(rows - 1), str(rows))], staged
