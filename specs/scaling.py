"""How many GPUs: the wall time of the spec's pretraining at each size, and where more GPUs stop helping.

Per optimizer step, each GPU (in replicas of `tensor_parallel` GPUs) computes its share of the step's FLOPs at a
per-GPU throughput (peak x the spec's assumed MFU, or scaled from what `compass preflight` measured), and each
replica's gradients are all-reduced once (bf16, ring: bytes x 2(n-1)/n over the bus bandwidth: NVLink within a
node, `internode_busbw_gbps` across nodes). The all-reduce overlaps the backward pass (two thirds of the compute,
bucketed as DDP and ZeRO do); only what exceeds it is exposed. So wall time falls as 1/n until the exposed
communication, which does not shrink with n, dominates (Amdahl), and data parallelism ends where every replica
holds one micro-batch of the global batch.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from compass.specs.costs import count_parameters, flops_per_token, planning_vocab
from compass.specs.spec import TrainingSpec

INTRANODE_BUSBW_GBPS = {"h100": 360.0, "h200": 360.0, "a100": 230.0, "l40s": 25.0, "cpu": 5.0}
BACKWARD_SHARE = 2 / 3  # of a step's FLOPs: what the gradient all-reduce can hide behind

def reduced_bytes(spec: TrainingSpec) -> int:
    """Bytes per gradient on the wire: fp32 where the gradients are summed and reduced in fp32 (how.reduce_precision,
    the recipe's default, or fp32 training), else the training precision's 2."""
    how = spec.how
    return 4 if how.precision == "fp32" or how.reduce_precision == "fp32" else 2


MATMUL_SHARE_OF_PEAK = 0.6  # of the data sheet's dense peak: what a healthy GPU reaches on a large bf16 matmul


@dataclass(frozen=True)
class ScalePoint:
    gpus: int
    wall_days: float
    exposed_comm_share: float  # of the wall time
    efficiency: float  # speedup over the smallest size / ideal speedup
    capped: bool  # beyond the global batch: more GPUs than micro-batches in a step


def step_shapes(spec: TrainingSpec) -> list[tuple[float, float, int]]:
    """(optimizer steps, FLOPs per step, micro-batches per step) of every pretraining stage: the phase this planner
    sizes (how.hardware); the others run on their own shapes (how.resources) and their days show per stage."""
    arch, vocab = spec.what.architecture, planning_vocab(spec)
    micro = spec.how.parallelism.micro_batch_size
    shapes = []
    for s in spec.what.pretraining.stages:
        tokens_per_step = s.global_batch_size * s.sequence_length
        stage_micro = getattr(s, "micro_batch_size", None) or micro
        shapes.append((s.tokens / tokens_per_step, flops_per_token(arch, vocab, s.sequence_length) * tokens_per_step,
                       s.global_batch_size // stage_micro))
    return shapes


def wall_days(spec: TrainingSpec, gpus: int, tflops_per_gpu: float | None = None) -> tuple[float, float, bool]:
    """(days, exposed communication share, capped by the global batch) with `gpus` GPUs: replicas of
    `tensor_parallel` GPUs each, data-parallel over the replicas."""
    hw = spec.how.hardware
    tp = spec.how.parallelism.tensor_parallel
    per_gpu = (tflops_per_gpu or hw.peak * hw.assumed_mfu) * 1e12
    replicas = max(1, gpus // tp)
    grad_bytes = reduced_bytes(spec) * count_parameters(spec.what.architecture, planning_vocab(spec)).total / tp
    busbw = (hw.internode_busbw_gbps if gpus > hw.devices_per_node else INTRANODE_BUSBW_GBPS[hw.accelerator]) * 1e9
    comm = grad_bytes * 2 * (replicas - 1) / replicas / busbw
    seconds = exposed_total = 0.0
    capped = False
    for steps, flops, micro_batches in step_shapes(spec):
        useful = min(replicas, micro_batches)  # a replica without a micro-batch of the step waits
        capped |= replicas > micro_batches
        compute = flops / (useful * tp * per_gpu)
        exposed = max(0.0, comm - BACKWARD_SHARE * compute)
        seconds += steps * (compute + exposed)
        exposed_total += steps * exposed
    return seconds / 86400, exposed_total / seconds if seconds else 0.0, capped


def scaling(spec: TrainingSpec, tflops_per_gpu: float | None = None, max_nodes: int = 1024) -> list[ScalePoint]:
    """Wall time at 1 node, then doubling node counts, up to where a step has no micro-batch left to give."""
    per_node = spec.how.hardware.devices_per_node
    sizes, nodes = {spec.how.hardware.total_devices}, 1
    while nodes <= max_nodes:
        sizes.add(nodes * per_node)
        if wall_days(spec, nodes * per_node, tflops_per_gpu)[2]:
            break
        nodes *= 2
    sizes = sorted(sizes)
    base_gpus = sizes[0]
    base_days = wall_days(spec, base_gpus, tflops_per_gpu)[0]
    points = []
    for n in sizes:
        days, comm, capped = wall_days(spec, n, tflops_per_gpu)
        points.append(ScalePoint(n, days, comm, (base_days / days) / (n / base_gpus), capped))
    return points


def gpus_for(spec: TrainingSpec, target_days: float, tflops_per_gpu: float | None = None,
             max_nodes: int = 4096) -> int | None:
    """The fewest whole nodes' GPUs that train the spec within `target_days` (None: no size does)."""
    per_node = spec.how.hardware.devices_per_node
    for nodes in range(1, max_nodes + 1):
        days, _, capped = wall_days(spec, nodes * per_node, tflops_per_gpu)
        if days <= target_days:
            return nodes * per_node
        if capped:
            return None
    return None


def stops_helping(points: list[ScalePoint], efficiency: float = 0.5) -> ScalePoint | None:
    """The first size whose parallel efficiency falls below `efficiency`, or that the global batch caps."""
    return next((p for p in points if p.efficiency < efficiency or p.capped), None)


def throughput_from_preflight(report: dict, assumed_mfu: float) -> float:
    """Per-GPU training TFLOP/s from a `compass preflight --json` report: the ranks' median matmul throughput
    scaled as the spec's MFU relates to a healthy matmul's share of peak (a cluster whose matmuls are slow
    trains proportionally slower)."""

    values = [r["matmul_tflops"] for r in report["rows"] if r.get("matmul_tflops")]
    if not values:
        raise ValueError("the preflight report has no matmul measurements")
    return statistics.median(values) * assumed_mfu / MATMUL_SHARE_OF_PEAK
