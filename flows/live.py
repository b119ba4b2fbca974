"""A training step seen while it runs, whatever runs it (in this process, torchrun, DeepSpeed or a Slurm job): a
thread beside the step reads what rank 0 writes in the step's work folder and
- logs a progress line and updates the step's Prefect progress artifact every how.monitoring.progress_every_s, and
  publishes a markdown artifact with the loss plot every how.monitoring.plot_every_s;
- emits a Prefect event for each checkpoint the trainer commits (`compass.checkpoint.committed`, resource
  `compass.checkpoint.<sha256 of the weights>`), which `compass deploy`'s automation turns into an evaluation.

Its work per tick is bounded whatever the run's length: it reads only the metrics lines written since the last
tick (MetricsTail), keeps the last rows whole and a downsampled series for the plot, and publishes the plot at its
own, slower cadence; every artifact it publishes counts in the step's resource ledger.
"""

from __future__ import annotations

import base64
import collections
import contextvars
import logging
import threading
import time
from pathlib import Path
from typing import Any

from compass.flows.reports.progress import STEP_PROGRESS, time_left
from compass.infra import resource_ledger
from compass.infra.layout import CheckpointFolder, ModelArtifact, WorkFolder
from compass.model.training.goodput import read_attempts, split
from compass.model.training.records import MetricsRow
from compass.tasks.common.plots import token_axis
from compass.tasks.common.training import loss_png
from compass.tasks.steps.kind import Step

CHECKPOINT_EVENT = "compass.checkpoint.committed"
PLOT_POINTS = 400  # the live plot's series is downsampled to at most this many points
RECENT_ROWS = 512  # kept whole: the time left (the stage's last steps), the tokens of a checkpoint just written


class MetricsTail:
    """The metrics file of a training work folder, read as it grows: each read parses only the lines written since
    the last one (a line being written waits for the next), keeping the last rows whole and every k-th row for the
    plot, k doubling whenever the series fills up. A file that shrank was replaced (a resume rewrote it): read
    again from its start."""

    def __init__(self, path: Path, points: int = PLOT_POINTS, recent: int = RECENT_ROWS):
        self.path, self.points, self.kept = path, points, recent
        self.bytes_read = 0  # over the tail's life, re-reads included
        self._reset()

    def _reset(self) -> None:
        self.recent: collections.deque[MetricsRow] = collections.deque(maxlen=self.kept)
        self.series: list[MetricsRow] = []
        self.every = 1  # the series keeps rows 0, every, 2 * every, ... of the file
        self.rows = 0  # rows read so far
        self.offset = 0

    def read(self) -> int:
        """Read what was appended since the last call; how many rows it held."""
        try:
            size = self.path.stat().st_size
        except FileNotFoundError:
            return 0
        if size < self.offset:
            self._reset()
        if size == self.offset:
            return 0
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            chunk = f.read(size - self.offset)
        end = chunk.rfind(b"\n") + 1  # whole lines only
        self.offset += end
        self.bytes_read += end
        added = 0
        for line in chunk[:end].splitlines():
            try:
                row = MetricsRow.model_validate_json(line)
            except ValueError:  # not a row (a torn write repaired later): skipped
                continue
            self._keep(row)
            added += 1
        return added

    def _keep(self, row: MetricsRow) -> None:
        if self.rows % self.every == 0:
            self.series.append(row)
            if len(self.series) > self.points:
                self.series = self.series[::2]
                self.every *= 2
        self.recent.append(row)
        self.rows += 1

    @property
    def last(self) -> MetricsRow | None:
        return self.recent[-1] if self.recent else None

    def plotted(self) -> list[MetricsRow]:
        """The plot's points: the downsampled series, ending with the newest row."""
        last = self.last
        return self.series + ([last] if last is not None and (not self.series or self.series[-1] is not last) else [])

    def tokens_at(self, stage_step: int) -> int | None:
        return next((r.tokens for r in reversed(self.recent) if r.stage_step == stage_step), None)


class LiveTraining:
    """Context manager around a training step's execution (see the module docstring)."""

    def __init__(self, step: Step, workdir: Path, run: str, store_root: str, every_s: float, events: bool,
                 log: logging.Logger | logging.LoggerAdapter, key: str, plot_every_s: float = 300.0):
        self.step, self.workdir, self.run, self.store_root = step, workdir, run, store_root
        self.every_s, self.events, self.log, self.key = every_s, events, log, key
        self.plot_every_s = plot_every_s
        self.stop = threading.Event()
        self.thread: threading.Thread | None = None
        self.progress_id: Any = None
        self.seen: set[int] = set()  # the steps of the checkpoints announced
        self.emitted: set[str] = set()  # weights announced by this step
        self.tail = MetricsTail(WorkFolder(workdir).metrics)
        self.rows_shown = 0
        self.plotted_at: float | None = None  # when the plot was last published (monotonic)
        self.ledger = resource_ledger.current()  # the step's, where its publications count

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
            self._tick(final=True)  # the stage's last checkpoint, unless the step already removed its work folder
            if self.progress_id is not None:  # committed: every step of it trained
                from prefect.artifacts import update_progress_artifact

                update_progress_artifact(self.progress_id, 100.0)

    def _loop(self) -> None:
        cpu = resource_ledger.ThreadCpu()
        while not self.stop.wait(self.every_s):
            try:
                self._tick()
            except Exception as exc:  # a display must never fail the step
                self.log.warning("live progress of %s: %s", self.step.id, exc)
        if self.ledger is not None:
            self.ledger.add(cpu_s=cpu.spent())

    def _tick(self, final: bool = False) -> None:
        self.tail.read()
        if self.tail.rows and self.tail.rows != self.rows_shown:
            self.rows_shown = self.tail.rows
            self._publish(final)
        if self.events:
            for folder in self._complete_checkpoints():
                if folder.step not in self.seen:
                    self.seen.add(folder.step)
                    self._emit(folder)

    def _publish(self, final: bool) -> None:
        from prefect.artifacts import create_markdown_artifact, create_progress_artifact, update_progress_artifact

        last = self.tail.last
        assert last is not None
        step = last.stage_step or 0
        total = last.stage_steps or step
        percent = round(100.0 * step / max(1, total), 1)
        if self.progress_id is None:
            self.progress_id = create_progress_artifact(progress=percent, key=f"{self.key}-progress",
                                                        description=f"{self.step.id}: training progress")
        else:
            update_progress_artifact(self.progress_id, percent)
        goodput = self._goodput()
        self.log.info(STEP_PROGRESS, self.step.id, step,
                      total, f"{percent:g}", last.loss, f"{last.tokens_per_s or 0:,.0f}", token_axis(last.tokens),
                      time_left(list(self.tail.recent)), f"; {goodput}" if goodput else "")
        published = 1
        now = time.monotonic()
        if final or self.plotted_at is None or now - self.plotted_at >= self.plot_every_s:
            self.plotted_at = now
            png = base64.b64encode(loss_png(self.tail.plotted(), f"{self.step.id} (live)", dpi=80)).decode()
            create_markdown_artifact(
                key=f"{self.key}-live",
                markdown=(f"### {self.step.id}: training, live\n\nstage `{last.stage}` step {step} of "
                          f"{total} ({percent}%), loss {last.loss:.4f}, {last.tokens_per_s or 0:,.0f} tokens/s, "
                          f"{token_axis(last.tokens)} tokens seen" + (f"; {goodput}" if goodput else "")
                          + f"\n\n![loss](data:image/png;base64,{png})\n"),
                description=f"{self.step.id}: live training progress")
            published += 1
        if self.ledger is not None:
            self.ledger.add(artifacts_published=published)

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
        tokens = self.tail.tokens_at(folder.step)
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
