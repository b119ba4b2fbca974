"""On a CUDA machine (`make test-gpu`): the collectives compass issues run on NCCL with the tensors its callers hand
them, CPU tensors included (the rank check and the stop flag build theirs on the CPU); gloo, which every CPU test
uses, would accept those as they are."""

from __future__ import annotations

import os

import pytest
import torch

pytestmark = pytest.mark.gpu


@pytest.fixture
def nccl(monkeypatch: pytest.MonkeyPatch):
    from compass.infra.net import free_port
    from compass.model.training import collectives

    if not torch.cuda.is_available():
        raise RuntimeError("make test-gpu needs a CUDA device: run it on a GPU node")
    env = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(free_port())}
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    torch.cuda.set_device(0)
    if torch.distributed.is_initialized():  # a group of one that an in-process FSDP2 or DeepSpeed test left open
        torch.distributed.destroy_process_group()
    torch.distributed.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
    try:
        yield collectives
    finally:
        torch.distributed.destroy_process_group()


def test_cpu_tensors_go_through_nccl_and_come_back_on_the_cpu(nccl):
    assert nccl.backend_device() == torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    mine = torch.tensor([0, 1, 12345, 678], dtype=torch.int64)  # what the rank check gathers
    (gathered,) = nccl.all_gather(mine)
    assert gathered.device.type == "cpu" and gathered.equal(mine)
    assert nccl.broadcast(torch.tensor([3]), 0).item() == 3
    assert nccl.any_rank(True) and not nccl.any_rank(False)
    assert nccl.all_reduce(torch.tensor([2.0]), "sum").device.type == "cpu"
    assert nccl.all_gather_object({"rows": [1, 2]}) == [{"rows": [1, 2]}]
    on_gpu = torch.ones(4, device="cuda")
    assert nccl.all_reduce(on_gpu) is on_gpu  # in place on the device: no copy
