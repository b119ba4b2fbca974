"""The planner's predicted goodput of each training stage: where its wall time will go besides computing, from the
spec's checkpoint cadence and sizes and the reliability numbers of how.hardware. The same causes as the ledger a run
records (model/training/goodput.py), so the plan and the run can be read side by side."""

from __future__ import annotations

import math
from dataclasses import dataclass

from compass.specs.costs import PHASE_OF_SECTION, count_parameters, memory_per_gpu, planning_vocab, stage_costs
from compass.specs.spec import TrainingSpec

HOST_COPY_GBPS = 25.0  # a GPU's device-to-host copy over PCIe 5 x16 in practice: an asynchronous checkpoint's stall
EXPORT_EVERY_ABOVE_1B = 10  # how.checkpoints.hf_export_every's default above 1B parameters (every one below)


@dataclass(frozen=True)
class PredictedSplit:
    """A stage's predicted wall time by cause (seconds), and what the prediction counted."""

    stage: str  # section:name
    compute_s: float
    startup_s: float
    checkpoint_s: float
    restart_s: float  # waiting to be scheduled again after an interruption
    redone_s: float  # steps computed again after an interruption: half a checkpoint interval on average
    interruptions: float  # expected over the stage
    checkpoints: int

    @property
    def total_s(self) -> float:
        return self.compute_s + self.startup_s + self.checkpoint_s + self.restart_s + self.redone_s

    @property
    def goodput(self) -> float:
        return self.compute_s / self.total_s if self.total_s > 0 else 0.0


def _batches(spec: TrainingSpec) -> dict[tuple[str, str], int]:
    """Sequences per optimizer step of every training stage, by (section, name)."""
    what = spec.what
    out = {("pretrain", s.name): s.global_batch_size for s in what.pretraining.stages}
    out |= {("long_context", s.name): s.global_batch_size for s in what.long_context.stages}
    out |= {("mid_training", s.name): s.batch_size for s in what.post_training if s.method == "mid_training"}
    return out


def exported_every(spec: TrainingSpec) -> int:
    """Every how many checkpoints a Hugging Face export is written (how.checkpoints.hf_export_every's default)."""
    params = count_parameters(spec.what.architecture, planning_vocab(spec)).total
    return spec.how.checkpoints.hf_export_every or (1 if params < 1e9 else EXPORT_EVERY_ABOVE_1B)


def predicted_splits(spec: TrainingSpec) -> list[PredictedSplit]:
    """Each training stage's predicted split. A checkpoint stalls training for the copy of a rank's state to host
    memory (asynchronous) or its whole write at the node's storage bandwidth (synchronous); an asynchronous write
    longer than the interval stalls the next one for the rest. A Hugging Face export gathers the model on rank 0 and
    writes it. Interruptions come at how.hardware.node_failures_per_day per node; each costs the requeue, a start-up
    and half a checkpoint interval of redone steps."""
    how = spec.how
    hw, every = how.hardware, how.checkpoints.every_steps
    params = count_parameters(spec.what.architecture, planning_vocab(spec)).total
    export_every = exported_every(spec)
    batches = _batches(spec)
    out = []
    for cost in stage_costs(spec):
        phase = PHASE_OF_SECTION[cost.section]
        shape = how.shape(phase)
        compute = cost.gpu_hours / max(1, cost.gpus) * 3600
        steps = max(1, int(cost.tokens // (batches[(cost.section, cost.name)] * cost.seq_len)))
        step_s = compute / steps
        checkpoints = math.ceil(steps / every)
        memory = memory_per_gpu(spec, how.parallelism.sharding_stage, cost.seq_len, phase=phase)
        state = memory.weights + memory.optimizer  # a rank's part of the training state
        write_s = state * max(1, shape.devices_per_node) / (hw.checkpoint_write_gbps * 1e9)  # the node's ranks share it
        if how.checkpoints.asynchronous:
            stall = state / (HOST_COPY_GBPS * 1e9) + max(0.0, write_s - every * step_s)
        else:
            stall = write_s
        exports = math.ceil(checkpoints / export_every)
        export_s = params * 2 / (hw.checkpoint_write_gbps * 1e9)  # bf16 weights, gathered and written by rank 0
        checkpoint_s = checkpoints * stall + exports * export_s
        interruptions = (compute + checkpoint_s) / 86400 * shape.nodes * hw.node_failures_per_day
        out.append(PredictedSplit(stage=f"{cost.section}:{cost.name}", compute_s=compute,
                                  startup_s=(1 + interruptions) * hw.startup_estimate_s, checkpoint_s=checkpoint_s,
                                  restart_s=interruptions * hw.requeue_s,
                                  redone_s=interruptions * min(every, steps) * step_s / 2,
                                  interruptions=interruptions, checkpoints=checkpoints))
    return out
