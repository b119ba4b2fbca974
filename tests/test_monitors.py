"""Training monitors: detection on loss series, and the actions on a real (diverging) training run."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from compass.model.training.monitors import TrainingMonitor
from compass.specs.training import Monitors, TrendMonitor

CONFIG = Monitors()


def test_spike_is_caught_before_the_step_and_normal_noise_is_not():
    mon = TrainingMonitor(CONFIG)
    losses = [4.0 - 0.01 * i + 0.02 * ((-1) ** i) for i in range(60)]
    for step, loss in enumerate(losses, 1):
        assert mon.check_before_step(step, loss, 1.0) is None
        mon.record(step, loss, 1000.0)
    event = mon.check_before_step(61, 6.5, 1.0)
    assert event.kind == "spike" and event.action == "rollback" and "bad batch" in event.cause


def test_divergence_on_nan_loss_or_gradient():
    mon = TrainingMonitor(CONFIG)
    assert mon.check_before_step(1, math.nan, 1.0).kind == "divergence"
    assert mon.check_before_step(1, 3.0, math.inf).kind == "divergence"


def test_slow_rise_plateau_and_throughput_drop_are_reported_once():
    cfg = Monitors(slow_rise=TrendMonitor(window=50, threshold=0.02), plateau=TrendMonitor(window=50, threshold=0.002))
    rising = TrainingMonitor(cfg)
    kinds = [e.kind for i in range(100) for e in rising.record(i, 3.0 + 0.01 * i, 1000.0)]
    assert kinds == ["slow_rise"]
    flat = TrainingMonitor(cfg)
    kinds = [e.kind for i in range(100) for e in flat.record(i, 3.0 + 0.0001 * (i % 2), 1000.0)]
    assert kinds == ["plateau"]
    slow = TrainingMonitor(cfg)
    speeds = [1000.0] * 30 + [300.0] * 10
    kinds = [e.kind for i, s in enumerate(speeds) for e in slow.record(i, 3.0 - 0.01 * i, s)]
    assert "throughput" in kinds and kinds.count("throughput") == 1


@pytest.mark.slow
def test_diverging_run_rolls_back_then_stops_with_cause_and_remedy(stage1_job, tmp_path: Path):
    from compass.model.training.monitors import TrainingStopped
    from compass.model.training.trainer import train_stage

    job = stage1_job(tmp_path, deepspeed=False)
    recipe = job.recipe
    job = job.model_copy(update={
        "recipe": recipe.model_copy(update={  # an absurd LR: the loss blows up
            "optimizer": recipe.optimizer.model_copy(update={"lr": 5e4, "grad_clip": 0.0}),
            "monitors": recipe.monitors.model_copy(update={"max_rollbacks": 2})})
    }).with_how(checkpoints=job.checkpoints.model_copy(update={"every_steps": 1}))
    with pytest.raises(TrainingStopped) as info:
        train_stage(job)
    message = str(info.value)
    assert "more than 2 rollbacks" in message and "Remedy:" in message
    assert info.value.event.kind in ("divergence", "spike")
    metrics = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert all(math.isfinite(m["loss"]) for m in metrics)  # rolled-back steps were taken out of the record
