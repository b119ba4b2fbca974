"""Where a step runs, acted on: one backend per placement, each with the same verbs (run a whole step, start ranks,
an executor for a datatrove stage, the machine checks, a description for the plan, the execution record, Ray's
resources). tasks/steps/placement.py decides the placement; `launcher_for(placement)` gives its backend; nothing
else acts on where work runs.

- local.py: this process, torchrun ranks, datatrove's local pool;
- ray.py: datatrove stages as Ray tasks;
- slurm.py: a whole step or a checkpoint's evaluation as a Slurm job, srun ranks inside it, job arrays
  (slurm_arrays.py), the cluster's machine checks (slurm_checks.py).

A new backend (Kubernetes, a cloud batch service) is one module here, its modes in placement.py's `Mode` and the
decision in `placed()`.
"""

from __future__ import annotations

from collections.abc import Iterable

from compass.specs.how import PHASES, How, Phase
from compass.tasks.steps.backends.base import (
    Backend,
    Description,
    MachineCheck,
    NotHere,
    Ranks,
    Stage,
    StageExecutor,
    WholeWork,
)
from compass.tasks.steps.backends.local import LocalBackend
from compass.tasks.steps.backends.ray import RayBackend
from compass.tasks.steps.backends.slurm import SlurmBackend, stale_work
from compass.tasks.steps.placement import HERE, Placement, place_phase

__all__ = ["BACKENDS", "Backend", "Description", "MachineCheck", "NotHere", "Ranks", "Stage", "StageExecutor",
           "WholeWork", "backends_of", "launcher_for", "one_of_each", "stale_work"]

BACKENDS: dict[str, type[Backend]] = {mode: cls for cls in (LocalBackend, RayBackend, SlurmBackend)
                                      for mode in cls.modes}


def launcher_for(placement: Placement) -> Backend:
    """The backend that acts on `placement`."""
    return BACKENDS[placement.mode](placement)


def backends_of(how: How, phases: Iterable[Phase]) -> list[tuple[Phase, Backend]]:
    """Each of the spec's phases with the backend its steps get (data fans out), in the phases' order; none: the
    orchestrating process's."""
    present = set(phases)
    placed = [(phase, launcher_for(place_phase(phase, how, fans_out=phase == "data")))
              for phase in PHASES if phase in present]
    return placed or [("data", launcher_for(HERE))]


def one_of_each(placed: list[tuple[Phase, Backend]]) -> list[Backend]:
    """The first backend of each kind among `placed`: what is checked or described once per kind of machine."""
    found: dict[type[Backend], Backend] = {}
    for _, backend in placed:
        found.setdefault(type(backend), backend)
    return list(found.values())
