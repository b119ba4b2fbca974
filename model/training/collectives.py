"""Every collective compass issues, in one place, each on the process group's device.

NCCL moves CUDA tensors only ("No backend type associated with device type cpu"), gloo CPU tensors; a rank check or
a stop flag built on the CPU works under gloo, which is what every test here runs, and kills a multi-rank CUDA job at
its first step. So no other module calls torch.distributed's collectives (tests/test_architecture.py checks it):
callers hand any tensor to these functions, which move it to the backend's device and give the result back on the
caller's device. Each collective of the group is numbered in this rank's collective ledger once one is kept
(model/training/collective_ledger.py): what the hang watchdog reads to name the ranks that did not join.
"""

from __future__ import annotations

import atexit
import gc
import os
import socket
import sys
from datetime import timedelta
from typing import Any, Literal, NoReturn

import psutil
import torch
import torch.distributed as dist

from compass.infra.net import free_port
from compass.model.training.collective_ledger import CollectiveLedger
from compass.model.training.rank_device import gpu_index

Op = Literal["sum", "max", "min"]
_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
CUDA_BACKENDS = ("nccl",)
_ledger: CollectiveLedger | None = None


def rank_env() -> tuple[int, int, int]:
    """(rank, world size, local rank) from the launcher's environment, (0, 1, 0) when run in-process."""
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("LOCAL_RANK", 0))


def local_world_size() -> int:
    """Ranks on this node: torchrun's LOCAL_WORLD_SIZE, DeepSpeed's launcher's LOCAL_SIZE, else every rank."""
    return int(os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("LOCAL_SIZE") or rank_env()[1])


def active() -> bool:
    return dist.is_available() and dist.is_initialized()


def world_size() -> int:
    return dist.get_world_size() if active() else 1


GLOO_TRANSPORT = "gloo/transport/"  # where gloo's own errors come from: a peer's connection closed, reset or timed out


def broke_a_collective(error: BaseException) -> bool:
    """The error is a collective broken under this rank (a peer lost, a connection closed, a collective timed out),
    a fault a retry may cure: torch's DistError (NCCL's DistBackendError among them), or gloo's transport error,
    which reaches Python as a plain RuntimeError naming its source file ("[../gloo/transport/tcp/pair.cc:553]
    Connection closed by peer")."""
    return isinstance(error, dist.DistError) or (isinstance(error, RuntimeError) and GLOO_TRANSPORT in str(error))


GLOO_INTERFACE = "GLOO_SOCKET_IFNAME"


def gloo_interface() -> str | None:
    """The network interface gloo groups use: GLOO_SOCKET_IFNAME where the cluster sets it, else the one this node
    reaches the launcher's rendezvous (MASTER_ADDR) through. Without a choice gloo takes the address the host name
    resolves to, which on a GPU node with several networks (Ethernet, InfiniBand's IPoIB, a container bridge) may
    be one the other nodes cannot reach: FSDP2's checkpoint group (and a CPU rank's training group) would then hang
    at its first collective across nodes. None: no rendezvous named, or no interface holds the route's address."""
    if os.environ.get(GLOO_INTERFACE):
        return os.environ[GLOO_INTERFACE]
    master = os.environ.get("MASTER_ADDR")
    if not master:
        return None
    try:
        family, _, _, _, address = socket.getaddrinfo(master, None, proto=socket.IPPROTO_UDP)[0]
        with socket.socket(family, socket.SOCK_DGRAM) as probe:  # no packet is sent: the kernel picks the route
            probe.connect((address[0], 9))
            local = probe.getsockname()[0]
    except OSError:
        return None
    for name, addresses in psutil.net_if_addrs().items():
        if any(a.address.split("%")[0] == local for a in addresses):
            return name
    return None


def _choose_gloo_interface() -> None:
    """Name the interface for every gloo group this process opens (read by gloo when a group is made)."""
    interface = gloo_interface()
    if interface and not os.environ.get(GLOO_INTERFACE):
        os.environ[GLOO_INTERFACE] = interface


def init(backend: str, timeout_s: float | None = None) -> None:
    """Join the launcher's process group (several ranks only; one rank needs none). `timeout_s`: how long a
    collective may wait before the backend gives up (the hang watchdog fires first, with every rank's stacks)."""
    rank, world, _ = rank_env()
    if world > 1 and not active():
        _choose_gloo_interface()
        timeout = timedelta(seconds=timeout_s) if timeout_s else None
        dist.init_process_group(backend=backend, rank=rank, world_size=world, timeout=timeout)


def group_of_one(backend: str) -> None:
    """A process group of this process alone, for a library that needs one even on one rank (FSDP2's device mesh);
    nothing when a group is open. Like the group DeepSpeed opens in-process, it stays open for the process."""
    if active():
        return
    if "MASTER_ADDR" in os.environ:  # a launcher's single rank: its rendezvous (torchrun's agent holds the store)
        dist.init_process_group(backend=backend, rank=0, world_size=1)
        return

    dist.init_process_group(backend=backend, init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)


def keep_ledger(ledger: CollectiveLedger | None) -> None:
    """Number this rank's collectives from now on in `ledger` (None: stop)."""
    global _ledger
    _ledger = ledger


def ledger() -> CollectiveLedger | None:
    return _ledger


def _entering(collective: str) -> None:
    if _ledger is not None:
        _ledger.enter(collective)


def backend_device(backend: str | None = None) -> torch.device:
    """Where the group's collectives move tensors: this rank's GPU for NCCL, the CPU for gloo (or no group)."""
    backend = backend or (dist.get_backend() if active() else "gloo")
    if backend in CUDA_BACKENDS:

        return torch.device("cuda", gpu_index())
    return torch.device("cpu")


def all_reduce(tensor: torch.Tensor, op: Op = "sum") -> torch.Tensor:
    """The reduction over every rank. A tensor already on the backend's device is reduced in place (no copy: the
    preflight's bandwidth test measures the collective, not a copy); another goes there and back. Returns the
    result on `tensor`'s device."""
    if not active():
        return tensor
    _entering("all_reduce")
    device = backend_device()
    if tensor.device == device:
        dist.all_reduce(tensor.detach(), op=_OPS[op])
        return tensor
    moved = tensor.detach().to(device)
    dist.all_reduce(moved, op=_OPS[op])
    return moved.to(tensor.device)


def any_rank(flag: bool, device: torch.device | None = None) -> bool:
    """True on every rank once it is true on any (ranks that must take the same branch, e.g. stop together)."""
    if not active():
        return flag
    return bool(all_reduce(torch.tensor([float(flag)], device=device or backend_device()), "max").item())


def all_gather(tensor: torch.Tensor) -> list[torch.Tensor]:
    """Every rank's tensor (same shape and dtype on every rank), rank order, on `tensor`'s device."""
    if not active():
        return [tensor.clone()]
    _entering("all_gather")
    moved = tensor.to(backend_device())
    everyone = [torch.empty_like(moved) for _ in range(world_size())]
    dist.all_gather(everyone, moved)
    return [t.to(tensor.device) for t in everyone]


def all_gather_object(obj: Any) -> list[Any]:
    """Every rank's picklable object, in rank order (NCCL needs the current CUDA device set: the trainer sets it)."""
    if not active():
        return [obj]
    _entering("all_gather_object")
    everyone: list[Any] = [None] * world_size()
    dist.all_gather_object(everyone, obj)
    return everyone


def broadcast(tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
    """`src`'s tensor on every rank, on `tensor`'s device."""
    if not active():
        return tensor
    _entering("broadcast")
    moved = tensor.to(backend_device(), copy=True)
    dist.broadcast(moved, src)
    return moved.to(tensor.device)


def side_group() -> Any:
    """A gloo group of every rank beside the training group, for collectives off the training thread (DCP's
    background checkpoint writes): the training group's collectives must stay in one order on every rank."""
    if not active():
        return None
    _choose_gloo_interface()
    return dist.new_group(backend="gloo")


def barrier() -> None:
    if active():
        _entering("barrier")
        dist.barrier()


def leave() -> None:
    """Wait for every rank, then tear the process groups down, so that no rank leaves while another still talks."""
    if active():
        _entering("barrier (leaving)")
        dist.barrier()
        dist.destroy_process_group()
        gc.collect()  # engines in reference cycles hold process groups: free them while threads can still take the GIL


def exit_process(code: int | None) -> NoReturn:
    """End a rank's process without the interpreter's finalization. A process group that a library still references
    (DeepSpeed keeps the world group) outlives `leave()`; its gloo worker, still freeing the last collective's tensors,
    then needs the GIL while the interpreter finalizes and aborts the process ("terminate called without an active
    exception", exit -6), failing a finished job now and then. Exit handlers and the standard streams run first."""
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(code or 0)
