"""Preflight: measure every rank before a long run, so a slow node is excluded before it slows all the others.

The playbook lost days to a node throttling on heat and to storage that could not feed the GPUs, and advises GPU
and network tests before launching. Each rank of `python -m compass.model.training.preflight OUT` (started by torchrun,
one process per device, on every node) measures:
- matmul throughput of its device (bf16 on GPU, fp32 on CPU), against the data sheet's dense peak on GPU;
- all-reduce bus bandwidth across every rank (NCCL on GPU, gloo on CPU), as nccl-tests defines it;
- write and read throughput of the store and of the node's staging folder (local rank 0 only: one per node);
- on CUDA, through NVML: temperature, SM clock, throttle reasons, ECC errors and memory;
- one packed-attention forward and backward through the kernel training takes on this device and this node's own
  torch (torch's varlen_attn on CUDA in bf16, compass's operator elsewhere), against dense masked attention in
  fp32: a torch whose kernel is missing or computes otherwise is found here, not at step 1.
It writes `rank-<rank>.json` in OUT; `judge` compares ranks with the median of their peers.
A duration repeats the measurements until it has passed (a burn-in) and keeps the worst of each.
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# NVML throttle reasons that mean the device is slowing itself down (not idle or app clocks)
BAD_THROTTLES = {0x2: "sw_power_cap", 0x8: "hw_slowdown", 0x20: "sw_thermal", 0x40: "hw_thermal",
                 0x80: "hw_power_brake"}
MEASURED = ("matmul_tflops", "allreduce_busbw_gbps")


def matmul_tflops(device: Any, seconds: float) -> float:
    import torch

    cuda = device.type == "cuda"
    n = 8192 if cuda else 1024
    dtype = torch.bfloat16 if cuda else torch.float32
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    a @ b  # warm-up
    done, start = 0, time.perf_counter()
    while True:
        for _ in range(4):
            a @ b
        done += 4
        if cuda:
            torch.cuda.synchronize(device)
        elapsed = time.perf_counter() - start
        if elapsed >= seconds:
            return done * 2 * n**3 / elapsed / 1e12


def allreduce_busbw_gbps(device: Any, megabytes: int, seconds: float) -> float | None:
    """nccl-tests' bus bandwidth: bytes x 2(n-1)/n per all-reduce over its time (None with one rank)."""
    import torch

    from compass.model.training import collectives

    world = collectives.world_size()
    if world == 1:
        return None
    tensor = torch.ones(megabytes * 2**20 // 4, dtype=torch.float32, device=device)
    collectives.all_reduce(tensor)  # warm-up, and the connections (in place: on the backend's device)
    done, start = 0, time.perf_counter()
    while True:
        collectives.all_reduce(tensor)
        done += 1
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if collectives.any_rank(time.perf_counter() - start >= seconds, device):  # every rank stops together
            elapsed = time.perf_counter() - start
            return tensor.numel() * 4 * 2 * (world - 1) / world * done / elapsed / 1e9


def everyone_agrees(done: bool, device: Any) -> bool:
    """True on every rank once any rank is done: each rank's own clock would end the burn-in after a different
    number of rounds, and a rank in the next all-reduce while its peer waits at the barrier aborts both."""
    from compass.model.training import collectives

    return collectives.any_rank(done, device)


def io_throughput(folder: Path, megabytes: int) -> dict[str, float]:
    """Sequential write (with fsync) then read of one file in `folder`, in MB/s. The read may come from the page
    cache: it bounds what the trainer can get, the write is the honest figure for a network file system."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f".compass-preflight-{socket.gethostname()}-{os.getpid()}"
    block = os.urandom(1 << 20)
    try:
        start = time.perf_counter()
        with path.open("wb") as f:
            for _ in range(megabytes):
                f.write(block)
            f.flush()
            os.fsync(f.fileno())
        write = megabytes / (time.perf_counter() - start)
        start = time.perf_counter()
        with path.open("rb") as f:
            while f.read(1 << 22):
                pass
        read = megabytes / (time.perf_counter() - start)
    finally:
        path.unlink(missing_ok=True)
    return {"write_mbps": round(write, 1), "read_mbps": round(read, 1)}


def gpu_health(gpu: str) -> dict[str, Any]:
    """NVML's view of one GPU (nvidia-ml-py, imported only here), named as CUDA_VISIBLE_DEVICES names it: NVML counts
    the node's GPUs itself, regardless of that variable (an index), or a UUID."""
    import pynvml

    pynvml.nvmlInit()
    try:
        handle = (pynvml.nvmlDeviceGetHandleByUUID(gpu) if gpu.startswith(("GPU-", "MIG-")) else
                  pynvml.nvmlDeviceGetHandleByIndex(int(gpu)))
        reasons = pynvml.nvmlDeviceGetCurrentClocksThrottleReasons(handle)
        memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
        try:
            ecc = pynvml.nvmlDeviceGetTotalEccErrors(handle, pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
                                                      pynvml.NVML_VOLATILE_ECC)
        except pynvml.NVMLError:
            ecc = None
        return {"temperature_c": pynvml.nvmlDeviceGetTemperature(handle, pynvml.NVML_TEMPERATURE_GPU),
                "sm_clock_mhz": pynvml.nvmlDeviceGetClockInfo(handle, pynvml.NVML_CLOCK_SM),
                "throttling": [name for bit, name in BAD_THROTTLES.items() if reasons & bit],
                "ecc_uncorrected": ecc, "memory_used_gib": round(memory.used / 2**30, 2),
                "memory_total_gib": round(memory.total / 2**30, 2)}
    finally:
        pynvml.nvmlShutdown()


PACKED_TOLERANCE = {"bfloat16": 5e-2, "float32": 1e-4}  # largest error relative to the reference's largest value


def packed_attention(device: Any) -> dict[str, Any]:
    """One packed micro-batch (2 rows, 4 documents, GQA 4:2) through `document_varlen`, forward and backward, against
    dense block-causal attention in fp32 on the host: the kernel, torch's version, the largest relative error of
    the output and the gradients, and whether it is within tolerance (or the error that stopped it)."""
    import torch
    import torch.nn.functional as F

    from compass.model.varlen import document_varlen, uses_torch_kernel

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    generator = torch.Generator().manual_seed(0)
    host = [torch.randn(2, heads, 64, 32, generator=generator) for heads in (4, 2, 2)]
    cu = torch.tensor([0, 20, 64, 100, 128], dtype=torch.int32)
    leaves = [t.to(device, dtype, copy=True).requires_grad_() for t in host]
    kernel = "torch varlen_attn" if uses_torch_kernel(leaves[0]) else "compass::packed_causal_attention"
    row: dict[str, Any] = {"kernel": kernel, "torch": torch.__version__, "dtype": str(dtype).removeprefix("torch.")}
    try:
        out, _ = document_varlen(None, *leaves, None, cu_seq_lens_q=cu.to(device), max_length_q=44)
        out.float().square().sum().backward()
    except Exception as exc:  # the check's finding: reported and judged, not a crash of the preflight
        return {**row, "ok": False, "error": f"{type(exc).__name__}: {exc}"[:400]}
    reference = [t.detach().clone().requires_grad_() for t in host]
    flat = [t.transpose(1, 2).reshape(128, t.shape[1], 32).transpose(0, 1) for t in reference]  # [H, T, D]
    document = torch.repeat_interleave(torch.arange(4), cu.diff().long())
    allowed = (document[:, None] == document[None, :]) & torch.ones(128, 128, dtype=torch.bool).tril()
    dense = F.scaled_dot_product_attention(*flat, attn_mask=allowed, enable_gqa=True)  # [H, T, D]
    dense.transpose(0, 1).reshape(2, 64, 4, 32).square().sum().backward()
    pairs = [(out.detach().float().cpu(), dense.transpose(0, 1).reshape(2, 64, 4, 32).detach())]
    pairs += [(leaf.grad.float().cpu(), ref.grad) for leaf, ref in zip(leaves, reference, strict=True)]
    error = max(float((got - want).abs().max() / want.abs().max()) for got, want in pairs)
    return {**row, "max_error": round(error, 6), "ok": error <= PACKED_TOLERANCE[row["dtype"]]}


def measure_rank(out: Path, store: Path | None, staging: Path | None, duration_s: float, megabytes: int,
                 check_packed: bool = True) -> dict:
    """This rank's measurements (the worst over `duration_s` when it is a burn-in)."""
    import torch

    from compass.model.training import collectives, rank_device

    rank, world, local_rank = collectives.rank_env()
    place = rank_device.resolve("gpu")  # the rank's GPU, as training resolves it
    cuda = place.type == "cuda"
    if cuda:
        torch.cuda.set_device(place.index)
    device = torch.device(place.torch_device)
    collectives.init("nccl" if cuda else "gloo")
    row: dict[str, Any] = {"node": place.node, "rank": rank, "local_rank": local_rank, "world": world,
                           "device": torch.cuda.get_device_name(device) if cuda else "cpu"}
    rounds: list[dict[str, Any]] = []
    deadline = time.monotonic() + duration_s
    while True:
        rounds.append({"matmul_tflops": matmul_tflops(device, 1.0),
                       "allreduce_busbw_gbps": allreduce_busbw_gbps(device, megabytes, 1.0)})
        if everyone_agrees(time.monotonic() >= deadline, device):
            break
    for key in MEASURED:
        values = [r[key] for r in rounds if r[key] is not None]
        row[key] = round(min(values), 4) if values else None
    row["rounds"] = len(rounds)
    if local_rank == 0:  # one file-system test per node
        for name, folder in (("store", store), ("staging", staging)):
            if folder is not None:
                row[name] = io_throughput(folder, megabytes)
    if cuda:
        row["gpu"] = gpu_health(place.gpu or str(place.index))
    if check_packed:
        row["packed_attention"] = packed_attention(device)
    (out / f"rank-{rank}.json").write_text(json.dumps(row))
    collectives.leave()  # gloo's threads left running abort the process at exit
    return row


@dataclass(frozen=True)
class Verdict:
    rows: list[dict]
    flagged: dict[str, list[str]]  # node -> why

    @property
    def exclude(self) -> str:
        """Ready for Slurm: --exclude=node1,node2 (empty when every node is fine)."""
        return f"--exclude={','.join(sorted(self.flagged))}" if self.flagged else ""


def _peer_median(values: list[float | None], index: int) -> float | None:
    peers = [v for j, v in enumerate(values) if j != index and v is not None]
    return statistics.median(peers) if peers else None


def judge(rows: list[dict], tolerance: float, expected: dict[str, float] | None = None) -> Verdict:
    """Flag ranks more than `tolerance` below the median of their peers (itself left out, so that with two ranks
    the slow one is compared with the other) or below the expected figure, nodes whose storage is that much slower
    than the other nodes', and GPUs that throttle or report uncorrected ECC errors."""
    flagged: dict[str, list[str]] = {}

    def flag(node: str, why: str) -> None:
        flagged.setdefault(node, []).append(why)

    for key in MEASURED:
        floor = (expected or {}).get(key)
        for i, r in enumerate(rows):
            value = r.get(key)
            if value is None:
                continue
            median = _peer_median([p.get(key) for p in rows], i)
            if median is not None and value < (1 - tolerance) * median:
                flag(r["node"], f"rank {r['rank']} {key} {value:.3g} is {1 - value / median:.0%} below the "
                                f"median {median:.3g}")
            if floor is not None and value < (1 - tolerance) * floor:
                flag(r["node"], f"rank {r['rank']} {key} {value:.3g} is below the expected {floor:.3g}")
    for name in ("store", "staging"):
        per_node = {r["node"]: r[name]["write_mbps"] for r in rows if name in r}
        for i, (node, value) in enumerate(per_node.items()):
            median = _peer_median(list(per_node.values()), i)
            if median is not None and value < (1 - tolerance) * median:
                flag(node, f"{name} writes {value:.0f} MB/s, {1 - value / median:.0%} below the median")
    for r in rows:
        packed = r.get("packed_attention")
        if packed and not packed["ok"]:
            flag(r["node"], f"rank {r['rank']} packed attention ({packed['kernel']}, torch {packed['torch']}) "
                            + (packed["error"] if "error" in packed else
                               f"is {packed['max_error']:.3g} off the reference (tolerance "
                               f"{PACKED_TOLERANCE[packed['dtype']]:g})"))
        gpu = r.get("gpu") or {}
        if gpu.get("throttling"):
            flag(r["node"], f"rank {r['rank']} GPU throttling: {', '.join(gpu['throttling'])}")
        if gpu.get("ecc_uncorrected"):
            flag(r["node"], f"rank {r['rank']} GPU has {gpu['ecc_uncorrected']} uncorrected ECC errors")
    return Verdict(sorted(rows, key=lambda r: r["rank"]), flagged)


def main(argv: list[str] | None = None) -> int:
    """`python -m compass.model.training.preflight OUT [STORE] [STAGING] DURATION MEGABYTES [packed|none]` on every
    rank (the last: whether training packs documents through the varlen path, so its kernel is checked)."""
    args = argv if argv is not None else sys.argv[1:]
    out, store, staging = Path(args[0]), args[1], args[2]
    measure_rank(out, Path(store) if store else None, Path(staging) if staging else None, float(args[3]),
                 int(args[4]), check_packed=(args[5] if len(args) > 5 else "packed") == "packed")
    return 0


if __name__ == "__main__":
    from compass.model.training import collectives

    collectives.exit_process(main())
