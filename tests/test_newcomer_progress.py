"""Progress a person can read (issue 45, item 4): after each step the run says how far it is (`[12/40] ... done: 9
ran, 3 cached, 30% of the plan in 4m02s`), and a training step's live line says how long its stage has left, from
its steps left at the mean time a step of it took. The end-to-end lines are checked in test_lifecycle's
quiet_terminal."""

from __future__ import annotations

from compass.flows.reports.progress import duration, run_progress, time_left
from compass.flows.reports.step_record import StepRecord
from compass.model.training.records import MetricsRow


def row(step: int, tokens_per_s: float = 1000.0, stage: str = "stage1") -> MetricsRow:
    return MetricsRow(step=step, stage=stage, stage_step=step, stage_steps=100, loss=3.0, tokens=512 * step,
                      tokens_per_s=tokens_per_s)


def test_the_run_says_how_far_it_is_after_each_step():
    results = [StepRecord(step="ingest:notes", uri="store/ingest/notes", executed=False, seconds=0, pid=1),
               StepRecord(step="curate:notes", uri="store/curate/notes", executed=True, seconds=2.5, pid=1)]
    assert run_progress(results, 8, 125.4) == "[2/8] curate:notes done: 1 ran, 1 cached, 25% of the plan in 2m05s"
    assert [duration(s) for s in (9.6, 61, 3725)] == ["10s", "1m01s", "1h02m"]


def test_a_training_stage_says_how_long_it_has_left():
    rows = [row(s) for s in range(1, 21)]  # 512 tokens a step at 1,000 tokens/s: 80 steps left, ~41 s
    assert time_left(rows) == ", about 41s left"
    # one slow step (a checkpoint's stall) moves the estimate by its share of the steps seen, not to its own rate
    # (the last step's rate alone said 6m50s here, and the next step 41s again: issue 75, item 6)
    stalled = [*rows[:-1], row(20, tokens_per_s=100.0)]
    assert time_left(stalled) == ", about 1m00s left"
    slower = [row(s, tokens_per_s=1000.0 if s <= 10 else 250.0) for s in range(1, 21)]  # a lasting slowdown counts
    assert time_left(slower) == ", about 1m46s left"
    assert time_left(rows[:1]) == ""  # one step: nothing to measure a step by yet
    other = [*rows, row(1, stage="stage2")]  # a new stage starts its own count
    assert time_left(other) == ""


def test_the_run_says_how_long_it_has_left_along_its_longest_chain_corrected_by_what_it_measured(tmp_path):
    """After each step: the plan's model of every step left (here stage 1 5 s, stage 2 3 s), times how much slower
    or faster the steps it timed ran, along the longest chain still to end (two ingests side by side count once);
    a step the model cannot time counts at the mean of its kind's (else all) steps this run computed."""
    from compass.flows.compiler import compile_spec
    from compass.flows.reports.run_clock import RunClock, predicted_seconds
    from compass.specs import load_spec
    from tests.conftest import write_minimal_spec

    spec = load_spec(write_minimal_spec(tmp_path)).spec
    plan = compile_spec(spec)
    assert set(predicted_seconds(spec, plan)) == {"pretrain:stage1", "pretrain:stage2"}
    clock = RunClock(plan, {"pretrain:stage1": 5.0, "pretrain:stage2": 3.0})

    def ended(step: str, seconds: float, executed: bool = True) -> StepRecord:
        return StepRecord(step=step, uri=f"store/{step}", executed=executed, seconds=seconds, pid=1)

    assert clock.line([]) == "; about 8s left in the run (the plan's model)"
    # ingest:code 4 s like ingest:notes, the rest of the data steps 4 s (all computed steps' mean): 16 s of data
    # steps on the chain ingest:code -> curate:code -> tokenizer -> tokenize, then 5 + 3 s
    assert clock.left_s([ended("ingest:notes", 4.0)]) == 24.0
    data = [ended(s.id, 0.0, executed=False) for s in plan.steps if s.kind != "pretrain"]
    assert clock.line([*data, ended("pretrain:stage1", 10.0)]) == \
        "; about 6s left in the run (the plan's model x 2, measured)"
    assert clock.line([*data, ended("pretrain:stage1", 10.0), ended("pretrain:stage2", 6.0)]) == ""
