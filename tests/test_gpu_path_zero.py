"""ZeRO-2 and ZeRO-3 through the whole trainer on 2 CPU ranks with accumulation 2, against ZeRO-0: the same losses
and global gradient norms, and the stage-end validation (which every rank must join when ZeRO-3 partitions the
weights: rank 0 alone would wait forever for the others' shards)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]  # a rank left out of a gather hangs


def metrics(workdir: Path, field: str) -> list[float]:
    return [json.loads(line)[field] for line in (workdir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def zero0(stage1_job, tmp_path_factory: pytest.TempPathFactory):
    from compass.tasks.common.training import run_training

    workdir = tmp_path_factory.mktemp("zero0")
    job = stage1_job(workdir, deepspeed=True, zero_stage=0, data_parallel=2, micro_batch_size=1)
    return workdir, run_training(job, logging.getLogger("test"))


@pytest.mark.parametrize("stage", [2, 3])
def test_zero_stage_trains_like_zero0_and_validates_on_every_rank(stage1_job, zero0, tmp_path: Path, stage: int):
    from compass.tasks.common.training import run_training

    reference_dir, reference = zero0
    job = stage1_job(tmp_path, deepspeed=True, zero_stage=stage, data_parallel=2, micro_batch_size=1)
    result = run_training(job, logging.getLogger("test"))
    assert metrics(tmp_path, "loss") == pytest.approx(metrics(reference_dir, "loss"), rel=1e-4)
    norms = metrics(tmp_path, "grad_norm")
    assert min(norms) > 0 and norms == pytest.approx(metrics(reference_dir, "grad_norm"), rel=1e-3)
    assert result.val_loss and result.val_loss == pytest.approx(reference.val_loss, rel=1e-4)
    # each rank stamped the shards it wrote; rank 0 committed them all without reading the other rank's
    from compass.model.training import checkpoints as ckpt

    last = ckpt.complete_checkpoints(tmp_path / "checkpoints")[-1]
    listed = json.loads((last / "checksums.json").read_text())
    on_disk = {p.relative_to(last).as_posix() for p in last.rglob("*") if p.is_file() and p.name != "checksums.json"}
    assert set(listed) == on_disk and any("rank_1" in name for name in listed)
    ckpt.verify(last)


def test_a_stop_asked_of_rank_0_stops_every_rank_after_the_step_with_a_checkpoint(stage1_job, tmp_path: Path,
                                                                                 monkeypatch: pytest.MonkeyPatch):
    """The scheduler's stop file is looked at by rank 0 only; its flag rides in the step's loss all-reduce, so both
    ranks checkpoint the same step and stop together (one rank stopping alone would hang the other)."""
    from compass.tasks.common.training import run_training

    stop = tmp_path / "stop"
    stop.touch()
    monkeypatch.setenv("COMPASS_STOP_FILE", str(stop))
    workdir = tmp_path / "work"
    job = stage1_job(workdir, deepspeed=True, zero_stage=1, data_parallel=2, micro_batch_size=1)
    with pytest.raises(FileNotFoundError):  # no result.json: the stage stopped early (Slurm requeues it)
        run_training(job, logging.getLogger("test"))
    assert [p.name for p in (workdir / "checkpoints").glob("step-*")] == ["step-00000001"]
    assert len(metrics(workdir, "loss")) == 1 and not (workdir / "result.json").exists()
