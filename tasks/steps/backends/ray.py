"""Ray: a data step whose datatrove stages run as Ray tasks (how.orchestration.task_runner: ray), its driver in the
orchestrating process; datatrove's RayPipelineExecutor shares the stages' ranks out over the Ray cluster."""

from __future__ import annotations

from collections.abc import Iterator

from compass.specs.base import Issue
from compass.specs.how import How
from compass.tasks.steps.backends.base import (
    Backend,
    Description,
    Log,
    MachineCheck,
    NotHere,
    Ranks,
    Stage,
    StageExecutor,
    T,
    WholeWork,
)
from compass.tasks.steps.backends.local import NO_CLUSTER, TiedExecutor


class RayBackend(Backend):
    modes = ("ray_tasks",)

    def run_whole(self, work: WholeWork[T], how: How, log: Log) -> T:
        return work.compute()  # the driver: its stages' Ray tasks compute

    def start_ranks(self, ranks: Ranks, how: How, log: Log) -> int:
        raise NotHere(f"{ranks.module}: a step placed on Ray tasks is a data step, whose stages run as Ray tasks; "
                      "it starts no ranks")

    def stage_executor(self, stage: Stage, how: How, log: Log) -> StageExecutor:
        from datatrove.executor import RayPipelineExecutor

        return TiedExecutor(RayPipelineExecutor(stage.pipeline, tasks=stage.tasks, workers=how.orchestration.workers,
                                          logging_dir=str(stage.logging_dir), skip_completed=True))

    def machine_checks(self, check: MachineCheck) -> Iterator[Issue]:
        return iter(())  # its stages need nothing of this machine; Ray's server is checked when the run starts

    def describe(self, how: How) -> Description:
        return Description(runs_as="Ray tasks", launch=how.hardware.launcher, notes=(NO_CLUSTER,),
                           places_devices="Ray")

    def ray_resources(self, how: How) -> dict[str, float] | None:
        return {"num_cpus": 0}  # its driver only waits: the stages' Ray tasks hold the CPUs
