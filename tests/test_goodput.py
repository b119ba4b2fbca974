"""The goodput ledger's split of a stage's wall time over its attempts: a restart, the work a resumed attempt
redid, a slow checkpoint, start-up and evaluation, each in its bucket (the real trainer's records after a kill -9
are checked in test_training)."""

from __future__ import annotations

import pytest

from compass.model.training.goodput import Attempt, Sums, split


def test_a_restart_redone_work_and_a_slow_checkpoint_land_in_their_buckets():
    # attempt 1: process at t=0, first step at 2; checkpoints submitted at steps 10 and 20, the one after step 20
    # slow (its 4 s stall lands in step 21's row); killed after step 27, last record at t=20
    first = Attempt(started_at=0.0, resumed_from=0, first_step=Sums(at=2.0), step=27,
                    marks={0: Sums(at=2.0), 10: Sums(at=6.0, data_wait_s=0.2, compute_s=3.5, checkpoint_s=0.1),
                           20: Sums(at=10.0, data_wait_s=0.4, compute_s=7.0, checkpoint_s=0.2)},
                    now=Sums(at=20.0, data_wait_s=0.6, compute_s=9.5, checkpoint_s=4.3))
    # attempt 2: requeued, its process starts at t=26 (6 s nobody trained), resumes from step 20's checkpoint,
    # first step at t=29, trains to the end (t=40) and validates for 1.5 s
    second = Attempt(started_at=26.0, resumed_from=20, first_step=Sums(at=29.0), step=40,
                     marks={20: Sums(at=29.0)}, now=Sums(at=40.0, data_wait_s=0.5, compute_s=9.0, checkpoint_s=0.3),
                     evaluation_s=1.5, ended_at=41.5)
    got = split([second, first])  # in any order
    assert got.attempts == 2 and got.total_s == pytest.approx(41.5)
    assert got.startup_s == pytest.approx(2.0 + 3.0)
    assert got.restart_s == pytest.approx(26.0 - 20.0)
    assert got.redone_s == pytest.approx(20.0 - 10.0)  # steps 21-27 (the slow checkpoint's stall among them)
    assert got.redone_steps == 27 - 20
    assert got.checkpoint_s == pytest.approx(0.2 + 0.3)  # the slow stall went with the redone steps
    assert got.compute_s == pytest.approx(7.0 + 9.0) and got.data_wait_s == pytest.approx(0.4 + 0.5)
    assert got.evaluation_s == pytest.approx(1.5)
    named = (got.compute_s + got.startup_s + got.data_wait_s + got.checkpoint_s + got.evaluation_s + got.restart_s
             + got.redone_s + got.other_s)
    assert named == pytest.approx(got.total_s)
    assert got.goodput == pytest.approx(16.0 / 41.5)
    line = got.line()
    assert line.startswith("goodput 39% (badput: redone 24%, restart 14%, start-up 12%") and line.endswith(
        "2 attempts")


def test_a_slow_checkpoint_in_the_kept_steps_is_a_checkpoint_stall_and_a_resume_past_the_last_record_redoes_nothing():
    # a time-limit stop: the checkpoint of step 30 is written, the attempt stops before its record of step 30
    stopped = Attempt(started_at=0.0, resumed_from=0, first_step=Sums(at=1.0), step=29, marks={},
                      now=Sums(at=30.0, data_wait_s=1.0, compute_s=20.0, checkpoint_s=6.0))
    resumed = Attempt(started_at=31.0, resumed_from=30, first_step=Sums(at=32.0), step=40, marks={},
                      now=Sums(at=40.0, compute_s=7.0), ended_at=40.0)
    got = split([stopped, resumed])
    assert got.redone_s == 0 and got.checkpoint_s == pytest.approx(6.0) and got.compute_s == pytest.approx(27.0)
    assert got.restart_s == pytest.approx(1.0)


def test_an_attempt_killed_while_it_starts_counts_its_start_up_and_the_restart_after_it(tmp_path, monkeypatch):
    """Rank 0 records its attempt once its process is up, before training starts: an attempt killed while starting
    (a rendezvous that hangs, a checkpoint that will not load) still counts. Before, it left no record: its start-up
    and the gap after it vanished from the stage's time. It trained nothing, so the next attempt's resume point is
    compared with the last attempt that trained."""
    from compass.model.training import goodput
    from compass.model.training.goodput import AttemptFile, read_attempts

    clock = Clock(30.0)
    monkeypatch.setattr(goodput, "time", clock)
    AttemptFile(tmp_path, started_at=26.0).begin()  # its process up at 30, then killed
    (starting,) = read_attempts(tmp_path)
    assert starting.resumed_from is None and starting.first_step is None and starting.now.at == 30.0
    trained = Attempt(started_at=0.0, resumed_from=0, first_step=Sums(at=2.0), step=27,
                      marks={0: Sums(at=2.0), 20: Sums(at=10.0, compute_s=7.0)}, now=Sums(at=20.0, compute_s=15.0))
    resumed = Attempt(started_at=40.0, resumed_from=20, first_step=Sums(at=42.0), step=40, marks={},
                      now=Sums(at=50.0, compute_s=8.0), ended_at=50.0)
    got = split([trained, starting, resumed])
    assert got.attempts == 3 and got.total_s == pytest.approx(50.0)
    assert got.startup_s == pytest.approx(2.0 + (30.0 - 26.0) + 2.0)
    assert got.restart_s == pytest.approx((26.0 - 20.0) + (40.0 - 30.0))
    assert got.redone_s == pytest.approx(20.0 - 10.0)  # the trained attempt's steps after 20
    assert got.compute_s == pytest.approx(7.0 + 8.0)


class Clock:
    """time.time() for the ledger, moved by the test."""

    def __init__(self, now: float):
        self.now = now

    def time(self) -> float:
        return self.now


def test_a_trl_step_s_slow_checkpoint_and_restart_land_in_their_buckets(tmp_path, monkeypatch):
    """The TRL ledger on the Trainer's callbacks: a batch fetched before `on_step_begin` is waiting for data, a
    save between `on_step_end` and `on_save` the checkpoint; a second attempt resuming from step 2's checkpoint makes
    the gap a restart and step 3 (computed after that checkpoint) redone work."""
    from types import SimpleNamespace

    from compass.model.training import goodput
    from compass.tasks.post_training import trl_goodput
    from compass.tasks.post_training.trl_goodput import TrlGoodput

    clock = Clock(100.0)
    monkeypatch.setattr(trl_goodput, "time", clock)
    monkeypatch.setattr(goodput, "time", clock)
    state = SimpleNamespace(global_step=0, is_world_process_zero=True)

    def step(data_s: float, compute_s: float, save_s: float | None = None) -> None:
        clock.now += data_s
        ledger.on_step_begin(None, state, None)
        clock.now += compute_s
        state.global_step += 1
        ledger.on_step_end(None, state, None)
        if save_s is not None:
            clock.now += save_s
            ledger.on_save(None, state, None)

    ledger = TrlGoodput(tmp_path, started_at=90.0, rank=0)  # 10 s of start-up before training begins
    clock.now = 100.0
    ledger.on_train_begin(None, state, None)
    step(0.5, 2.0)
    step(0.5, 2.0, save_s=6.0)  # a slow checkpoint at step 2
    step(0.5, 2.0)  # step 3, then the process is killed (its last record is at 113.5)
    clock.now = 120.0  # requeued: the next attempt's process starts 6.5 s later, resumes from step 2
    state.global_step = 2
    ledger = TrlGoodput(tmp_path, started_at=120.0, rank=0)
    clock.now = 124.0
    ledger.on_train_begin(None, state, None)
    step(0.5, 2.0)
    step(0.5, 2.0, save_s=1.0)
    clock.now += 0.5  # the final save
    got = ledger.finish()
    assert got is not None and got.attempts == 2 and got.total_s == pytest.approx(130.5 - 90.0)
    assert got.startup_s == pytest.approx(10.0 + 4.0)
    assert got.restart_s == pytest.approx(120.0 - 113.5)
    assert got.redone_s == pytest.approx(2.5) and got.redone_steps == 1  # step 3 of the first attempt
    assert got.checkpoint_s == pytest.approx(6.0 + 1.0)
    assert got.compute_s == pytest.approx(4 * 2.0) and got.data_wait_s == pytest.approx(4 * 0.5)
    assert got.other_s == pytest.approx(0.5)
    other_rank = TrlGoodput(tmp_path / "rank1", started_at=0.0, rank=1)
    other_rank.on_train_begin(None, SimpleNamespace(global_step=0, is_world_process_zero=False), None)
    assert other_rank.finish() is None and not (tmp_path / "rank1").exists()  # rank 0 alone keeps the record
