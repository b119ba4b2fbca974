"""The CUDA path checked on this CPU machine: what gloo forgives and NCCL does not. Collectives go through one module
(compass.model.training.collectives; tests/test_architecture.py fails on any other caller) that moves every tensor
to the backend's device; the same code on NCCL runs in tests/gpu/ (`make test-gpu`)."""

from __future__ import annotations

import pytest
import torch

from compass.model.training import collectives


def test_the_backend_decides_where_collective_tensors_live(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert collectives.backend_device("nccl") == torch.device("cuda", 3)  # NCCL moves CUDA tensors only
    assert collectives.backend_device("gloo") == torch.device("cpu")
    assert collectives.backend_device() == torch.device("cpu")  # no process group: nothing to move


@pytest.fixture
def no_group():
    """An in-process DeepSpeed run earlier in the session may have left its group of one open."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def test_without_a_process_group_each_collective_is_this_rank_alone(no_group):
    t = torch.tensor([1.0, 2.0])
    assert collectives.all_reduce(t, "max") is t and collectives.all_gather(t)[0].equal(t)
    assert collectives.broadcast(t) is t and collectives.all_gather_object({"a": 1}) == [{"a": 1}]
    assert collectives.any_rank(True) and not collectives.any_rank(False)
    assert collectives.world_size() == 1


def test_a_group_of_one_goes_through_the_backend(no_group, tmp_path):
    """A group of one still runs every collective through its backend (on NCCL that is what tests/gpu checks on a
    single GPU); results come back on the caller's device."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        t = torch.tensor([3.0])
        assert collectives.active() and collectives.world_size() == 1
        assert collectives.broadcast(t).equal(t) and collectives.all_reduce(t, "max").equal(t)
        assert collectives.all_gather(t)[0].equal(t) and collectives.any_rank(True)
    finally:
        dist.destroy_process_group()
