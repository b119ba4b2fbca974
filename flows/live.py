"""A training step seen while it runs, whatever runs it (in this process, torchrun, DeepSpeed or a Slurm job): a
thread beside the step reads what rank 0 writes in the step's work folder and
- updates the step's Prefect progress artifact and a markdown artifact with the loss plot every few seconds;
- emits a Prefect event for each checkpoint the trainer commits (`compass.checkpoint.committed`, resource
  `compass.checkpoint.<sha256 of the weights>`), which `compass deploy`'s automation turns into an evaluation.
"""

from __future__ import annotations

import base64
import contextvars
import logging
import threading
from pathlib import Path
from typing import Any

from compass.flows.reports.progress import time_left
from compass.infra.layout import CheckpointFolder, ModelArtifact, WorkFolder
from compass.model.training.goodput import read_attempts, split
from compass.model.training.records import MetricsRow
from compass.tasks.common.plots import token_axis
from compass.tasks.common.training import loss_png
from compass.tasks.steps.kind import Step

CHECKPOINT_EVENT = "compass.checkpoint.committed"


class LiveTraining:
    """Context manager around a training step's execution (see the module docstring)."""

    def __init__(self, step: Step, workdir: Path, run: str, store_root: str, every_s: float, events: bool,
                 log: logging.Logger | logging.LoggerAdapter, key: str):
        self.step, self.workdir, self.run, self.store_root = step, workdir, run, store_root
        self.every_s, self.events, self.log, self.key = every_s, events, log, key
        self.stop = threading.Event()
        self.thread: threading.Thread | None = None
        self.progress_id: Any = None
        self.seen: set[int] = set()  # the steps of the checkpoints announced
        self.emitted: set[str] = set()  # weights announced by this step
        self.rows_shown = 0

    def __enter__(self) -> LiveTraining:
        # nothing counts as seen: checkpoints written while no orchestrator watched (it died; the Slurm job trained
        # on) are announced now. One announced before is not scored twice: the evaluation flow finds its result.
        self.seen = set()
        context = contextvars.copy_context()  # the task run's context: artifacts link to it
        self.thread = threading.Thread(target=context.run, args=(self._loop,), name=f"live-{self.step.id}",
                                       daemon=True)
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        if self.thread is not None:
            self.thread.join(timeout=60)
        if exc[0] is None:
            self._tick()  # the stage's last checkpoint, unless the step already removed its work folder
            if self.progress_id is not None:  # committed: every step of it trained
                from prefect.artifacts import update_progress_artifact

                update_progress_artifact(self.progress_id, 100.0)

    def _loop(self) -> None:
        while not self.stop.wait(self.every_s):
            try:
                self._tick()
            except Exception as exc:  # a display must never fail the step
                self.log.warning("live progress of %s: %s", self.step.id, exc)

    def _tick(self) -> None:
        rows = self._metrics()
        if rows and len(rows) != self.rows_shown:
            self.rows_shown = len(rows)
            self._publish(rows)
        if self.events:
            for folder in self._complete_checkpoints():
                if folder.step not in self.seen:
                    self.seen.add(folder.step)
                    self._emit(folder)

    def _metrics(self) -> list[MetricsRow]:
        path = WorkFolder(self.workdir).metrics
        if not path.exists():
            return []
        rows = []
        for line in path.read_text().splitlines():
            try:
                rows.append(MetricsRow.model_validate_json(line))
            except ValueError:  # the line being written
                break
        return rows

    def _publish(self, rows: list[MetricsRow]) -> None:
        from prefect.artifacts import create_markdown_artifact, create_progress_artifact, update_progress_artifact

        last = rows[-1]
        step = last.stage_step or 0
        total = last.stage_steps or step
        percent = round(100.0 * step / max(1, total), 1)
        if self.progress_id is None:
            self.progress_id = create_progress_artifact(progress=percent, key=f"{self.key}-progress",
                                                        description=f"{self.step.id}: training progress")
        else:
            update_progress_artifact(self.progress_id, percent)
        goodput = self._goodput()
        self.log.info("%s: step %d of %d (%s%%), loss %.4f, %s tokens/s, %s tokens seen%s%s", self.step.id, step,
                      total, f"{percent:g}", last.loss, f"{last.tokens_per_s or 0:,.0f}", token_axis(last.tokens),
                      time_left(rows), f"; {goodput}" if goodput else "")
        png = base64.b64encode(loss_png(rows, f"{self.step.id} (live)", dpi=80)).decode()
        create_markdown_artifact(
            key=f"{self.key}-live",
            markdown=(f"### {self.step.id}: training, live\n\nstage `{last.stage}` step {step} of "
                      f"{total} ({percent}%), loss {last.loss:.4f}, {last.tokens_per_s or 0:,.0f} tokens/s, "
                      f"{token_axis(last.tokens)} tokens seen" + (f"; {goodput}" if goodput else "")
                      + f"\n\n![loss](data:image/png;base64,{png})\n"),
            description=f"{self.step.id}: live training progress")

    def _goodput(self) -> str | None:
        """The stage's goodput so far over its attempts (rank 0's ledger in the work folder), as one phrase."""

        try:
            attempts = read_attempts(WorkFolder(self.workdir).goodput)
            return split(attempts).line() if attempts else None
        except (OSError, ValueError):  # a record being replaced
            return None

    def _complete_checkpoints(self) -> list[CheckpointFolder]:
        """The stage's exported checkpoints, kept or pruned before their evaluation."""
        return WorkFolder(self.workdir).everything_to_evaluate()

    def after_commit(self, uri: str, manifest: Any) -> None:
        """Checkpoints the step committed that no event announced yet (the step removes its work folder as soon
        as it commits, sometimes before this thread saw its last checkpoint)."""
        if not self.events:
            return
        for entry in manifest.files:
            name = ModelArtifact.kept_weights(entry.path)
            if name is not None and entry.sha256 not in self.emitted:
                self._announce(f"{uri}/{entry.path.rsplit('/', 1)[0]}", name, entry.sha256, None)

    def _emit(self, folder: CheckpointFolder) -> None:
        sha = folder.committed_sha256(folder.weights)
        if sha is None:
            return
        tokens = next((r.tokens for r in self._metrics() if r.stage_step == folder.step), None)
        self._announce(str(folder.hf), folder.root.name, sha, tokens)

    def _announce(self, path: str, name: str, sha: str, tokens: int | None) -> None:
        from prefect.events import emit_event

        self.emitted.add(sha)
        checkpoint = {"path": path, "step": self.step.id, "folder": name, "weights_sha256": sha, "tokens": tokens}
        folder = Path(path)
        emit_event(event=CHECKPOINT_EVENT,
                   resource={"prefect.resource.id": f"compass.checkpoint.{sha[:20]}",
                             "prefect.resource.name": f"{self.step.id} {name}",
                             "compass.uri": path if "://" in path else folder.as_uri(), "compass.run": self.run,
                             "compass.step": self.step.id},
                   payload={"checkpoint": checkpoint, "store_root": self.store_root})
        self.log.info("checkpoint %s of %s committed: event %s emitted", name, self.step.id, CHECKPOINT_EVENT)
