"""Where a step runs: the one decision, made here from the kind's resources and the spec's `how`.

A kind declares the resources its steps need (StepKind.resources: the shape of one of the spec's phases, or its
own); what acts on the placement is its backend (tasks/steps/backends/: `launcher_for(placement)`), which every
consumer asks (the runner, the rank launches, datatrove's stages, checkpoint evaluation, validation, the plan).
Nothing else decides where work runs, and nothing but the backends acts on the mode.

- in_process: the orchestrating process runs it (no cluster, one rank; or no resources: bookkeeping);
- local_ranks: the orchestrating machine launches its ranks with torchrun (or over ssh to how.hardware.hosts);
- ray_tasks: a data step whose datatrove work spreads over Ray (task_runner: ray), its driver here;
- slurm_job: a Slurm job of the step's shape runs it whole and commits it; the orchestrator submits, follows
  and reads what it committed (every step that computes, with a cluster). A kind that fans out (its work is
  datatrove stages) gets a one-CPU driver job instead, and its stages run as Slurm job arrays of the phase's
  shape (Placement.tasks: datatrove's SlurmPipelineExecutor, tasks/steps/backends/slurm_arrays.py);
- in_slurm_job: what the step sees inside that job: its ranks start with srun over the job's nodes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, Protocol

from compass.specs.how import How, Phase, Shape
from compass.tasks.steps.step_config import StepConfig

Mode = Literal["in_process", "local_ranks", "ray_tasks", "slurm_job", "in_slurm_job"]
Resources = Callable[[StepConfig, How], Shape]  # a kind's resources: its steps' shape, from its config and `how`


class Placeable(Protocol):
    """What placing a step reads of its kind (tasks/steps/kind.py StepKind provides it)."""

    @property
    def resources(self) -> Resources | None: ...

    @property
    def fans_out(self) -> bool: ...


def phase(name: Phase) -> Resources:
    """The resources of a kind whose steps take the shape of one of the spec's phases (how.resources)."""

    def shape(config: StepConfig, how: How) -> Shape:
        return how.shape(name)

    shape.__qualname__ = f"phase({name!r})"
    return shape


@dataclass(frozen=True)
class Placement:
    mode: Mode
    shape: Shape | None  # None: a step that only reads other steps' manifests (comparisons, curves, reports)
    tasks: Shape | None = None  # a fanning-out step under a cluster: what its Slurm job arrays share out, one CPU each

    @property
    def computes_here(self) -> bool:
        """The orchestrating process computes the step (and imports what its kind needs); else a Slurm job does."""
        return self.mode != "slurm_job"

    @property
    def holds_devices(self) -> bool:
        """It holds this machine's devices (GPUs, or training ranks on CPU) while it runs: such steps take turns
        (the `gpu` tag's concurrency limit). A Slurm job's devices are Slurm's to share out, Ray's are Ray's."""
        return self.mode in ("in_process", "local_ranks") and bool(self.shape and self.shape.devices_per_node)

    @property
    def drives_arrays(self) -> bool:
        """Its datatrove stages run as Slurm job arrays (a fanning-out step under a cluster)."""
        return self.tasks is not None

    def inside_job(self) -> Placement:
        """The placement the step itself sees once its Slurm job runs it."""
        return Placement("in_slurm_job", self.shape, self.tasks)


HERE = Placement("in_process", None)


def place(kind: Placeable, config: StepConfig, how: How) -> Placement:
    """Where one step of `kind` with `config` runs under `how`."""
    if kind.resources is None:
        return HERE  # bookkeeping: it reads manifests, never a model or a corpus
    return placed(kind.resources(config, how), how, kind.fans_out)


def place_phase(phase: Phase, how: How, fans_out: bool = False) -> Placement:
    """Where a step of the phase's shape runs: the plan's table, validation's machine checks, a checkpoint's
    evaluation (the same decision as its steps')."""
    return placed(how.shape(phase), how, fans_out)


def placed(shape: Shape, how: How, fans_out: bool = False) -> Placement:
    """Where a step of `shape` runs under `how`; `fans_out`: its work is datatrove stages."""
    if how.orchestration.cluster is not None:
        if fans_out:
            return Placement("slurm_job", driver(shape), tasks=shape)
        return Placement("slurm_job", shape)
    if shape.phase == "data" and how.orchestration.task_runner == "ray":
        return Placement("ray_tasks", shape)
    if shape.ranks > 1:
        return Placement("local_ranks", shape)
    return Placement("in_process", shape)


DRIVER_MEMORY_GB = 2.0


def driver(tasks: Shape) -> Shape:
    """The job of a step whose work runs in Slurm job arrays: one CPU on one node that submits the arrays, waits
    for them, merges their statistics and commits; the phase's nodes and CPUs go to the arrays."""
    return Shape(phase=tasks.phase, nodes=1, devices_per_node=0, cpus_per_node=1, memory_gb=DRIVER_MEMORY_GB,
                 time_limit=tasks.time_limit, whole_nodes=False, partition=tasks.partition)
