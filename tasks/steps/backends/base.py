"""What every backend does, and the typed work it is handed.

A backend is a placement with verbs (datatrove's executors are the model: a pipeline never knows where it runs).
Every backend implements every verb; a verb that has no meaning where it is asked (the ranks of a step placed as a
Slurm job, asked of the orchestrator) raises NotHere, naming what runs the work instead.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Generic, Literal, Protocol, TypeVar

from compass.infra.manifest import Execution
from compass.specs.base import Issue, Loc
from compass.specs.how import Hardware, How
from compass.specs.spec import TrainingSpec
from compass.tasks.steps.placement import Mode, Placement

Log = logging.Logger | logging.LoggerAdapter
T = TypeVar("T")
SMOKE_HINT = "or exercise the spec on this CPU first: compass run SPEC --smoke"


class NotHere(RuntimeError):
    """A verb asked of a placement where it has no meaning."""


@dataclass(frozen=True)
class WholeWork(Generic[T]):
    """One unit a placement runs whole: a step (flows/runner.py) or one checkpoint's evaluation
    (tasks/evaluation/checkpoint_job.py). Computed here, or by a job running `python -m module job_file`."""

    what: str  # "pretrain:stage1": log lines, the full-disk message, errors
    label: str  # a job's name is compass-<label> (at most 40 characters)
    workdir: Path  # on the shared root under a cluster: the job file, script, log and record
    module: str  # `python -m module job_file` computes it inside a job
    job_file: Path
    job_text: Callable[[Placement], str]  # the job file's text, given the placement the job will see
    compute: Callable[[], T]  # compute (and commit) it in this process
    done: Callable[[], bool]  # committed, or written (also by a job nobody watched)
    collect: Callable[[], T]  # what a finished job left, read once done() holds
    on_job: Callable[[str], None] = lambda job_id: None  # hears the Slurm job id (the step's lock records it)


@dataclass(frozen=True)
class Ranks:
    """`world` ranks of `python -m module job_path`, working in the job file's folder, over the nodes (and hosts)
    `hardware` names."""

    module: str
    job_path: Path
    world: int
    hardware: Hardware
    launcher: Literal["torchrun", "deepspeed"] = "torchrun"


@dataclass(frozen=True)
class Stage:
    """One datatrove pipeline of `tasks` ranks. `work_bytes`: its input bytes times what a byte costs it (None:
    unknown); a local stage with little of it runs in this process."""

    pipeline: list
    tasks: int
    logging_dir: Path  # completion markers, per-rank statistics and failures, Slurm logs, the array record
    name: str  # "<run>-<stage>": a job array is named compass-<name>
    work_bytes: float | None = None


class StageExecutor(Protocol):
    """What a stage's caller needs of its executor (datatrove's executors have both)."""

    def run(self) -> None: ...

    def get_incomplete_ranks(self, ranks: Iterable[int] | None = None,
                             skip_completed: bool | None = None) -> list[int]: ...


@dataclass(frozen=True)
class MachineCheck:
    """What validation hands a backend to check the machines its steps will run on. `rehearsal`: CPU ranks stand in
    for GPUs (CUDA and the GPU extras are the ranks' to check); `node_paths`: the paths outside the store the steps
    read, by path (spec field, what it is), built lazily (by flows/validation.py)."""

    spec: TrainingSpec
    base_dir: Path
    rehearsal: bool
    node_paths: Callable[[], dict[str, tuple[Loc, str]]]
    # the checks that write (a probe job's token under the shared root): not for a spec that already has problems,
    # whose other checks still run in the same pass: bad input writes nothing
    writes: bool = True


@dataclass(frozen=True)
class Description:
    """A placement as the plan shows it: the phase's "runs as" cell, how its ranks start, the notes and settings
    rows of its own, and who shares the devices out (None: this process)."""

    runs_as: str
    launch: str
    notes: tuple[str, ...] = ()
    places_devices: str | None = None
    settings: tuple[tuple[str, str], ...] = ()


class Backend(ABC):
    """A placement and every verb that acts on it."""

    modes: ClassVar[tuple[Mode, ...]]

    def __init__(self, placement: Placement):
        self.placement = placement

    @abstractmethod
    def run_whole(self, work: WholeWork[T], how: How, log: Log) -> T:
        """Compute the work where the placement says and return what it made."""

    @abstractmethod
    def start_ranks(self, ranks: Ranks, how: How, log: Log) -> int:
        """Start the ranks and wait for them; their exit status (0: every rank ended well)."""

    @abstractmethod
    def stage_executor(self, stage: Stage, how: How, log: Log) -> StageExecutor:
        """The executor that runs one datatrove stage here (its `run()` returns once the stage is over)."""

    @abstractmethod
    def machine_checks(self, check: MachineCheck) -> Iterator[Issue]:
        """What the spec needs of the machines this placement runs its steps on, as located issues."""

    @abstractmethod
    def describe(self, how: How) -> Description:
        """How the plan shows a phase placed so."""

    def ray_resources(self, how: How) -> dict[str, float] | None:
        """What the Prefect task computing the step asks Ray for under the Ray task runner (None: Ray's default)."""
        shape = self.placement.shape
        if how.orchestration.task_runner != "ray":
            return None
        if self.placement.holds_devices and shape is not None and how.hardware.accelerator != "cpu":
            return {"num_gpus": shape.devices_per_node}
        return None

    def execution(self) -> Execution:
        """Where this execution ran, for the manifest: the mode and the shape."""
        shape = self.placement.shape
        return Execution(mode=self.placement.mode, nodes=shape.nodes if shape else 1,
                         devices_per_node=shape.devices_per_node if shape else 0)
