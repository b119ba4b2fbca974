"""One datatrove stage, run by the executor its step's backend gives (tasks/steps/backends/): datatrove's
LocalPipelineExecutor with the phase's CPUs, its RayPipelineExecutor on Ray tasks, or, under a Slurm cluster, its
SlurmPipelineExecutor as job arrays submitted from the step's driver job; then its ranks' statistics, merged.

A stage's datatrove logging folder (completion markers, per-rank statistics, Slurm logs) lives in the step's work
folder, which survives a failed attempt: a relaunched step skips the ranks that completed and redoes only the rest.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict

from compass.tasks.steps.backends import Stage, launcher_for
from compass.tasks.steps.context import Runtime


class BlockStats(BaseModel):
    """One pipeline block's counters, summed over the stage's ranks (datatrove's merged statistics)."""

    model_config = ConfigDict(frozen=True)

    name: str
    stats: dict[str, Any]


class StageStats(BaseModel):
    model_config = ConfigDict(frozen=True)

    stage: str
    tasks: int
    blocks: list[BlockStats]


class StageIncomplete(RuntimeError):
    """Some ranks of a stage did not complete: the step fails, and its relaunch redoes only those ranks."""


def run_stage(runtime: Runtime, stage: str, logs: Path, pipeline: list, tasks: int,
              log: logging.Logger | logging.LoggerAdapter, input_bytes: int | None = None,
              cost_per_byte: float = 1.0) -> StageStats:
    """Run one datatrove pipeline of `tasks` ranks with the executor the placement says and return its merged
    block statistics; raises StageIncomplete naming the ranks that did not complete. `input_bytes`, when known,
    times `cost_per_byte` (what a byte costs this stage against reading and writing it: specs/how.CONTENT_BYTE_COST):
    a local stage with less than how.orchestration.in_process_below_mib of such work runs in this process."""
    logging_dir = logs / stage
    work = input_bytes * cost_per_byte if input_bytes is not None else None
    executor = launcher_for(runtime.placement).stage_executor(
        Stage(pipeline, tasks, logging_dir, f"{runtime.run}-{stage}", work), runtime.how, log)
    executor.run()
    from compass.tasks.steps.backends.executors import rank_failure

    missing = executor.get_incomplete_ranks(range(tasks), skip_completed=True)
    failures = [e for e in (rank_failure(logging_dir, r) for r in missing) if e is not None]
    if failures:  # the first failed rank's own error (a broken record names its file and line)
        log.warning("datatrove stage %s: ranks %s of %d failed; run again to redo only those", stage, missing, tasks)
        raise failures[0]
    if missing:  # Ray's executor logs a lost task group and returns; an array task may be cancelled or fail
        raise StageIncomplete(f"datatrove stage {stage} finished without ranks {missing} of {tasks}; see "
                              f"{logging_dir / 'logs'}; run again to redo only those ranks")
    blocks = _merged_block_stats(logging_dir, tasks)
    return StageStats(stage=stage, tasks=tasks,
                      blocks=[BlockStats(name=str(b.get("name")), stats=_plain(b.get("stats", {}))) for b in blocks])


def link_outputs(src: Path, dst: Path) -> int:
    """The files the stages wrote under `src` into the artifact folder `dst`: hard links where both are on one
    file system (the work folder keeps its copy until the commit, for a relaunch), else copies. Returns how many."""
    count = 0
    for path in sorted(src.rglob("*")):
        if path.is_file():
            count += 1
            target = dst / path.relative_to(src)
            target.parent.mkdir(parents=True, exist_ok=True)
            try:
                os.link(path, target)
            except OSError:
                shutil.copy2(path, target)
    return count


def _merged_block_stats(logging_dir: Path, tasks: int) -> list[dict[str, Any]]:
    """The stage's statistics merged from every rank's file, whichever attempt ran it (an executor's own
    stats.json covers only the ranks it ran, and Ray's is missing when it counted a resubmitted task as failed)."""
    from datatrove.utils.stats import PipelineStats

    total = PipelineStats()
    for rank in range(tasks):
        total += PipelineStats.from_json(json.loads((logging_dir / "stats" / f"{rank:05d}.json").read_text()))
    return json.loads(total.to_json())


def rank_block_stats(logs: Path, stage: str, tasks: int, block: str) -> list[dict[str, Any]]:
    """One block's counters for each rank of a completed stage, in rank order (a rank's shard is its own)."""
    from datatrove.utils.stats import PipelineStats

    found = []
    for rank in range(tasks):
        stats = PipelineStats.from_json(json.loads((logs / stage / "stats" / f"{rank:05d}.json").read_text()))
        blocks = json.loads(stats.to_json())
        found.append(next((_plain(b.get("stats", {})) for b in blocks if b.get("name") == block), {}))
    return found


def _plain(stats: dict[str, Any]) -> dict[str, Any]:
    return {key: value.get("total", value) if isinstance(value, dict) else value for key, value in stats.items()}
