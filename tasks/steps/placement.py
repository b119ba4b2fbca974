"""Where a step runs: the one decision, made here from the kind's resources and the spec's `how`.

A kind declares the resources its steps need (StepKind.resources: the shape of one of the spec's phases, or its
own); what acts on the mode is the placement's launcher (tasks/steps/launchers.py), which the runner, the rank
launches and datatrove's executor ask. Nothing else decides where work runs.

- in_process: the orchestrating process runs it (no cluster, one rank; or no resources: bookkeeping);
- local_ranks: the orchestrating machine launches its ranks with torchrun (or over ssh to how.hardware.hosts);
- ray_tasks: a data step whose datatrove work spreads over Ray (task_runner: ray), its driver here;
- slurm_job: a Slurm job of the step's shape runs it whole and commits it; the orchestrator submits, follows
  and reads what it committed (every step that computes, with a cluster). A kind that fans out (its work is
  datatrove stages) gets a one-CPU driver job instead, and its stages run as Slurm job arrays of the phase's
  shape (Placement.tasks: datatrove's SlurmPipelineExecutor, tasks/data/datatrove_stages.py);
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
    def computes(self) -> bool:
        return self.shape is not None

    @property
    def ranks(self) -> int:
        return self.shape.ranks if self.shape else 0

    def inside_job(self) -> Placement:
        """The placement the step itself sees once its Slurm job runs it."""
        return Placement("in_slurm_job", self.shape, self.tasks)


HERE = Placement("in_process", None)


def place(kind: Placeable, config: StepConfig, how: How) -> Placement:
    """Where one step of `kind` with `config` runs under `how`."""
    if kind.resources is None:
        return HERE  # bookkeeping: it reads manifests, never a model or a corpus
    shape = kind.resources(config, how)
    if how.orchestration.cluster is not None:
        if kind.fans_out:
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
