"""One device resolution for every rank (model/training/rank_device.py), from what the launcher and Slurm give it:
torchrun and compass's srun (`--gpus-per-node`, no GPU binding) let each rank see its node's GPUs and open the
one at its local rank; a task bound to its own GPU opens it only as its node's one rank; anything else is refused
with what the rank saw. On a machine without CUDA the rank records the GPU it would open, and computes on the CPU
only in a rehearsal."""

from __future__ import annotations

import pytest

from compass.model.training.rank_device import DeviceError, resolve


def rank(local: int, local_world: int, visible: str | None, node: str = "gpu-007") -> dict[str, str]:
    env = {"LOCAL_RANK": str(local), "LOCAL_WORLD_SIZE": str(local_world), "RANK": str(8 + local),
           "SLURMD_NODENAME": node}
    return env | ({"CUDA_VISIBLE_DEVICES": visible} if visible is not None else {})


def test_each_rank_opens_the_gpu_at_its_local_rank_among_its_nodes():
    node = [resolve("h100", cuda_available=True, env=rank(i, 4, "4,5,6,7")) for i in range(4)]
    assert [(d.index, d.gpu) for d in node] == [(0, "4"), (1, "5"), (2, "6"), (3, "7")]
    assert {d.torch_device for d in node} == {"cuda:0", "cuda:1", "cuda:2", "cuda:3"}  # distinct on the node
    assert node[2].node == "gpu-007" and node[2].describe() == "cuda:2 (GPU 6)"
    unset = resolve("h100", cuda_available=True, env=rank(5, 8, None))  # nothing restricts it: the node's order
    assert (unset.index, unset.gpu) == (5, "5")
    assert node[0].visible == ("4", "5", "6", "7") and unset.visible is None  # what the rank saw, recorded


def test_a_task_bound_to_its_own_gpu_opens_it_only_as_its_nodes_one_rank():
    alone = resolve("h100", cuda_available=True, env=rank(0, 1, "3"))
    assert (alone.index, alone.gpu) == (0, "3")
    with pytest.raises(DeviceError, match=r"local rank 2 of 8 on gpu-007 sees GPUs 2 .*--gpus-per-node and no"):
        resolve("h100", cuda_available=True, env=rank(2, 8, "2"))  # DeepSpeed would open cuda:2 beside it
    with pytest.raises(DeviceError, match="sees no GPU"):
        resolve("h100", cuda_available=True, env=rank(0, 1, ""))


def test_without_cuda_a_rank_computes_on_the_cpu_and_records_the_gpu_it_would_open():
    rehearsed = resolve("h100", cuda_available=False, env=rank(1, 2, "0,1"))
    assert rehearsed.type == "cpu" and rehearsed.torch_device == "cpu"
    assert rehearsed.describe() == "cpu (would open cuda:1 (GPU 1))"
    plain = resolve("cpu", cuda_available=True, env=rank(1, 2, "0,1"))  # the spec asks for no GPU
    assert plain.describe() == "cpu" and plain.index is None


def test_a_gpu_specs_rank_without_cuda_is_refused_unless_rehearsing(monkeypatch: pytest.MonkeyPatch):
    """A node whose driver, job or torch build lost its GPUs must not train a GPU spec on its CPU without a word:
    only a rehearsal's ranks (COMPASS_REHEARSAL, exported by `compass run --rehearse`) compute there. The trainer's
    ranks and the libraries' (TRL, lighteval) refuse it alike."""
    from compass.model.training.rank_device import REHEARSAL_ENV, refuse_cpu_ranks
    from compass.model.training.trainer import training_device
    from compass.specs.how import How
    from compass.tasks.common.devices import device_for

    with pytest.raises(DeviceError, match=r"rank 9 on gpu-007: how.hardware.accelerator is h100 but CUDA is not "
                                          r"available here .*nvidia-smi.*--rehearse"):
        refuse_cpu_ranks("h100", cuda_available=False, env=rank(1, 2, "0,1"))
    refuse_cpu_ranks("h100", cuda_available=False, env=rank(1, 2, "0,1") | {REHEARSAL_ENV: "1"})  # rehearsing
    refuse_cpu_ranks("h100", cuda_available=True, env=rank(1, 2, "0,1"))
    refuse_cpu_ranks("cpu", cuda_available=False, env=rank(1, 2, "0,1"))  # the spec asks for no GPU

    import torch

    if torch.cuda.is_available():
        return  # the entry points below reach their GPU here
    monkeypatch.delenv(REHEARSAL_ENV, raising=False)
    with pytest.raises(DeviceError, match="accelerator is h100 but CUDA is not available"):
        training_device("h100")
    with pytest.raises(DeviceError, match="accelerator is h100 but CUDA is not available"):
        device_for(How.model_validate({"hardware": {"accelerator": "h100"}}))
    monkeypatch.setenv(REHEARSAL_ENV, "1")
    assert training_device("h100")[0].type == "cpu" and device_for(
        How.model_validate({"hardware": {"accelerator": "h100"}})).device == "cpu"


def test_nccl_collectives_move_tensors_to_the_ranks_own_gpu(monkeypatch: pytest.MonkeyPatch):
    from compass.model.training import collectives

    for key, value in rank(1, 2, "6,7").items():
        monkeypatch.setenv(key, value)
    assert str(collectives.backend_device("nccl")) == "cuda:1"
    assert str(collectives.backend_device("gloo")) == "cpu"
