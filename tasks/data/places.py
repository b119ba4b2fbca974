"""Where a data step's datatrove stages write.

With a local store, everything a stage writes stays in the step's work folder (on the cluster's shared root under
Slurm), and the last stage's shards are linked into the artifact at the end. With a remote store (S3), nothing
the size of a source touches the step's disk: intermediate stages (filtered copies, dedup signatures) write under
the step's work prefix in the store (`.work/<kind>/<name>-<fp>/`, removed once the step commits), and the last
stage writes its shards straight into the artifact's own folder, whose manifest the commit writes last, from the
digests the writers recorded (tasks/data/written_files.py). Completion markers, statistics and logs stay in the
local work folder either way: small, and what datatrove and Slurm need on a file system.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from compass.tasks.data.datatrove_stages import link_outputs
from compass.tasks.data.written_files import recorded
from compass.tasks.steps.context import StepContext


@dataclass(frozen=True)
class DataPlaces:
    local: Path  # the step's local work folder: the stages' logs, per-rank records of written files, side files
    work: str  # the folder (local path or URL) under which intermediate stages write
    artifact: str | None  # a remote store: the artifact's folder URL, where the last stage writes; else None

    @classmethod
    def of(cls, ctx: StepContext) -> DataPlaces:
        local = ctx.workdir / "datatrove"
        store = ctx.store
        if store is None or not store.is_remote:
            return cls(local=local, work=str(local), artifact=None)
        return cls(local=local, work=f"{store.root}/.work/{ctx.work_key}/datatrove", artifact=ctx.uri.rstrip("/"))

    @property
    def remote(self) -> bool:
        return self.artifact is not None

    @property
    def stage_logs(self) -> Path:
        """Where each stage keeps datatrove's logging folder (completion markers, statistics, logs)."""
        return self.local / "logs"

    def intermediate(self, name: str) -> str:
        """An intermediate stage's output folder."""
        return f"{self.work}/{name}"

    def output(self, work_name: str, under: str = "") -> str:
        """The last stage's output folder: `<artifact>/<under>` on a remote store, else the work folder's
        `work_name` (linked into the artifact's `under` by `publish`)."""
        if self.artifact is not None:
            return f"{self.artifact}/{under}".rstrip("/")
        return self.intermediate(work_name)

    def records(self, stage: str) -> str | None:
        """Where a stage's writers record what they wrote: only on a remote store, whose commit takes them."""
        return str(self._records(stage)) if self.remote else None

    def _records(self, stage: str) -> Path:
        return self.local / "written" / stage

    def publish(self, ctx: StepContext, stages: list[str], work_name: str, under: str = "") -> int:
        """Make the last stages' shards part of the artifact; returns how many files. Local: linked from the work
        folder into the staging folder. Remote: already in place; their recorded digests go to the commit."""
        if self.artifact is None:
            return link_outputs(Path(self.intermediate(work_name)), ctx.out / under)
        written = [e for stage in stages for e in recorded(str(self._records(stage)), under)]
        ctx.published.extend(written)
        return len(written)

