"""Training callbacks: everything around the optimizer step that is not the step itself (metrics, progress,
monitors with their rollbacks, checkpoints), each behind named hooks so new behaviour is a new callback, not
more lines in the loop.

Hooks, in the order the loop calls them:
- `on_start(trainer)`: before the first step (after resuming);
- `pre_step(trainer)`: before a batch is drawn;
- `before_update(trainer, loss, grad_norm)`: gradients are ready, the optimizer has not stepped; raise
  `Rollback` to restore the newest checkpoint and skip the batches since, or `TrainingStopped` to end;
- `post_step(trainer, record)`: the step is applied and `trainer.step` counts it; `record` is its metrics line;
- `post_checkpoint(trainer, folder)`: a complete checkpoint was committed;
- `post_restore(trainer, step)`: a rollback restored the checkpoint of `step`;
- `on_error(trainer, exc)`: the loop is ending with an exception;
- `on_end(trainer)`: the stage trained to its last step.

A callback that keeps state across steps (a monitor's windows, its rollback count) returns it from `state_dict()`:
every checkpoint holds it and a resumed or requeued job continues with it (`load_state_dict`), as it continues
the data position; a rollback does not restore it (the rollback count must survive the rollback).
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Any

from tqdm import tqdm

from compass.infra.errors import StopRequested
from compass.infra.layout import WorkFolder
from compass.model.training import checkpoints as ckpt
from compass.model.training import collectives
from compass.model.training.loop_view import TrainingLoop
from compass.model.training.monitors import Event, TrainingMonitor, TrainingStopped
from compass.model.training.records import PHASES, MetricsRow, read_metrics, write_metrics
from compass.specs.training import Monitors

log = logging.getLogger("compass.train")


class Rollback(Exception):
    """Raised from `before_update`: restore the newest good checkpoint and skip the batches since."""

    def __init__(self, event: Event):
        super().__init__(event.describe())
        self.event = event


class Callback:
    """Base class: every hook does nothing."""

    def on_start(self, trainer: TrainingLoop) -> None: ...
    def pre_step(self, trainer: TrainingLoop) -> None: ...
    def before_update(self, trainer: TrainingLoop, loss: float, grad_norm: float) -> None: ...
    def post_step(self, trainer: TrainingLoop, row: MetricsRow) -> None: ...
    def post_checkpoint(self, trainer: TrainingLoop, folder: Path) -> None: ...
    def post_restore(self, trainer: TrainingLoop, step: int) -> None: ...
    def on_error(self, trainer: TrainingLoop, exc: BaseException) -> None: ...
    def on_end(self, trainer: TrainingLoop) -> None: ...

    def state_dict(self) -> dict[str, Any] | None:
        """What a checkpoint keeps of this callback (None: nothing)."""
        return None

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class Monitoring(Callback):
    """The playbook's failure patterns (spikes, divergence, slow rises, plateaus, throughput drops), each with
    the action the spec sets: warn, roll back (at most `max_rollbacks` times), or stop."""

    def __init__(self, monitors: Monitors, on_gpu: bool = True):
        self.monitors = monitors
        self.monitor = TrainingMonitor(monitors, on_gpu)
        self.rollbacks = 0

    def before_update(self, trainer: TrainingLoop, loss: float, grad_norm: float) -> None:
        if trainer.monitor_stopped:  # a stop decided after the last step, on this rank or another: all stop here,
            # each with the deciding rank's event (every rank is here together: one gather, only when stopping)
            decided = [e for e in collectives.all_gather_object(trainer.monitor_stop) if e is not None]
            raise TrainingStopped(decided[0])
        event = self.monitor.check_before_step(trainer.global_step + 1, loss, grad_norm)
        if event is None:
            return
        trainer.report(event)
        if event.action == "stop":
            raise TrainingStopped(event)
        if event.action == "rollback":
            self.rollbacks += 1
            if self.rollbacks > self.monitors.max_rollbacks:
                raise TrainingStopped(event, f"(more than {self.monitors.max_rollbacks} rollbacks)")
            raise Rollback(event)

    def post_step(self, trainer: TrainingLoop, row: MetricsRow) -> None:
        phases = {phase: row.seconds(phase) for phase in PHASES if getattr(row, f"{phase}_s") is not None}
        for event in self.monitor.record(row.step, row.loss, row.tokens_per_s or 0.0, phases):
            trainer.report(event)
            if event.action == "stop" and trainer.monitor_stop is None:
                # decided from this rank's own timings (throughput): the others learn it in the next step's
                # all-reduce and every rank stops before that update (raising here alone hung the rest)
                trainer.monitor_stop = event

    def post_restore(self, trainer: TrainingLoop, step: int) -> None:
        self.monitor.forget_since_rollback()

    def state_dict(self) -> dict[str, Any]:
        return {"rollbacks": self.rollbacks, **self.monitor.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.rollbacks = state["rollbacks"]
        self.monitor.load_state_dict(state)

    def on_end(self, trainer: TrainingLoop) -> None:
        if trainer.rank == 0 and trainer.events:
            with open(WorkFolder(trainer.job.workdir).events, "a") as f:
                f.writelines(e.model_dump_json() + "\n" for e in trainer.events)


class MetricsFile(Callback):
    """One JSON line per optimizer step in `metrics.jsonl` (rank 0); on resume or rollback the lines after the
    restored step are dropped, since those steps are trained again."""

    def __init__(self, path: Path):
        self.path = path

    def on_start(self, trainer: TrainingLoop) -> None:
        if trainer.rank == 0:
            truncate_metrics(self.path, trainer.global_step)

    def post_step(self, trainer: TrainingLoop, row: MetricsRow) -> None:
        if trainer.rank == 0:
            with open(self.path, "a") as f:
                f.write(row.line())

    def post_restore(self, trainer: TrainingLoop, step: int) -> None:
        if trainer.rank == 0:
            truncate_metrics(self.path, trainer.offset + step)


class Progress(Callback):
    """A progress bar on a terminal (rank 0) and a log line every 5% of the stage."""

    def __init__(self) -> None:
        self.bar: Any = None

    def on_start(self, trainer: TrainingLoop) -> None:

        self.bar = tqdm(total=trainer.stage_steps, initial=trainer.step, desc=trainer.stage.name, unit="step",
                        disable=trainer.rank != 0 or not sys.stderr.isatty())

    def post_step(self, trainer: TrainingLoop, row: MetricsRow) -> None:
        if trainer.rank != 0:
            return
        self.bar.update(1)
        self.bar.set_postfix(loss=f"{row.loss:.3f}", lr=f"{row.lr:.1e}")
        step, total = trainer.step, trainer.stage_steps
        if step % max(1, total // 20) == 0 or step == total:
            log.info("%s step %d/%d loss %.4f lr %.2e grad %.2f %.0f tok/s", trainer.stage.name, step, total,
                     row.loss, row.lr, row.grad_norm, row.tokens_per_s)

    def post_restore(self, trainer: TrainingLoop, step: int) -> None:
        self.bar.n = step

    def on_end(self, trainer: TrainingLoop) -> None:
        self.bar.close()

    def on_error(self, trainer: TrainingLoop, exc: BaseException) -> None:
        self.bar.close()


class Checkpointing(Callback):
    """A checkpoint every `every` steps and at the stage's end, with a Hugging Face export in every
    `export_every`-th and the last; the newest `keep_last` and the stage end stay. With `pending`, the exports of
    pruned checkpoints are moved there, to be evaluated (checkpoints.prune)."""

    def __init__(self, every: int, keep_last: int, export_every: int = 1, pending: Path | None = None):
        self.every, self.keep_last, self.export_every, self.pending = every, keep_last, export_every, pending

    def post_step(self, trainer: TrainingLoop, row: MetricsRow) -> None:
        last = trainer.step == trainer.stage_steps
        if trainer.step % self.every == 0 or last:
            trainer.save_checkpoint(export=last or (trainer.step // self.every) % self.export_every == 0)

    def post_checkpoint(self, trainer: TrainingLoop, folder: Path) -> None:
        if trainer.rank == 0:
            ckpt.prune(folder.parent, self.keep_last, keep={trainer.stage_steps}, pending=self.pending)


class StopWhenAsked(Callback):
    """A job near its time limit asks to stop (the batch shell touches `stop_file`, or the process gets SIGUSR1):
    after the current step every rank agrees (the flag rides in the step's loss all-reduce; only rank 0 looks at
    the file, which lives on the shared root), a checkpoint of that step is written unless one just was, and the
    trainer stops; the requeued job resumes from it."""

    signalled = False  # set by the SIGUSR1 handler of `compass.model.trainer.main`

    def __init__(self, stop_file: Path):
        self.stop_file = stop_file

    def on_start(self, trainer: TrainingLoop) -> None:
        trainer.stop_asked_here = lambda: StopWhenAsked.signalled or (trainer.rank == 0 and self.stop_file.exists())

    def post_step(self, trainer: TrainingLoop, row: MetricsRow) -> None:
        if not trainer.stop_asked or trainer.step == trainer.stage_steps:  # the stage's end is checkpointed anyway
            return
        if trainer.written is None or trainer.written != ckpt.step_dir(trainer.checkpoint_root, trainer.step):
            trainer.save_checkpoint(export=False)  # for the requeued job to resume from
        trainer.checkpoint_blocked_s += trainer.settle_checkpoint_writes()
        raise StopRequested(trainer.step)


def truncate_metrics(path: Path, keep_through_step: int) -> None:
    """Drop metric lines written after `keep_through_step` (they will be written again)."""
    if not path.exists():
        return
    write_metrics(path, [row for row in read_metrics(path) if row.step <= keep_through_step])
