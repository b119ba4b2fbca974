"""How far a run and a training step have come, in the words the log shows: `[12/40] ... done` after each step,
and a training step's time left in its live progress line."""

from __future__ import annotations

from compass.flows.reports.step_record import StepRecord
from compass.model.training.records import MetricsRow

# a training step's live progress line (its arguments: step id, step, steps, percent, loss, tokens/s, tokens seen,
# time left, goodput); the terminal's live display reads them from the record (flows/live_display.py)
STEP_PROGRESS = "%s: step %d of %d (%s%%), loss %.4f, %s tokens/s, %s tokens seen%s%s"


def duration(seconds: float) -> str:
    """1h02m, 3m05s or 12s."""
    seconds = int(round(seconds))
    if seconds >= 3600:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    return f"{seconds // 60}m{seconds % 60:02d}s" if seconds >= 60 else f"{seconds}s"


def run_progress(results: list[StepRecord], total: int, elapsed_s: float) -> str:
    """The run's progress after a step ends: steps done of the plan's, how many ran and how many were cached, and
    the time so far (each training step's own time left is in its live progress line: time_left)."""
    ran = sum(r.executed for r in results)
    return (f"[{len(results)}/{total}] {results[-1].step} done: {ran} ran, {len(results) - ran} cached, "
            f"{len(results) / total:.0%} of the plan in {duration(elapsed_s)}")


def time_left(rows: list[MetricsRow]) -> str:
    """`, about 3m05s left` in the stage: its steps left at the mean time a step of it took over the rows seen
    (each step's tokens over its own tokens per second), so one slow or fast step (a checkpoint's stall, a warm
    cache) does not swing it as the last step's rate did (23 s -> 48 s -> 62 s); empty until two steps of the
    stage have been seen."""
    stage = [r for r in rows if r.stage == rows[-1].stage and r.stage_step is not None and r.tokens_per_s]
    if len(stage) < 2 or not stage[-1].stage_steps:
        return ""
    first, last = stage[0], stage[-1]
    if last.stage_step <= first.stage_step:  # type: ignore[operator]
        return ""
    per_step = (last.tokens - first.tokens) / (last.stage_step - first.stage_step)  # type: ignore[operator]
    step_s = sum(per_step / r.tokens_per_s for r in stage[1:]) / (len(stage) - 1)  # type: ignore[operator]
    left = (last.stage_steps - last.stage_step) * step_s  # type: ignore[operator]
    return f", about {duration(left)} left"
