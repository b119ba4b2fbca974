"""A disk that fills while ranks write (issue 47): a checkpoint write on a full disk ends the ranks; the step says the
one DiskFull message (the path, what is free, what to do) instead of "the ranks ended without their result", and
Prefect does not retry it at once. Found by reading what chaos.py's disk-full kind could not reach: it fills the
disk at the commit, after the ranks are done."""

from __future__ import annotations

import errno
import logging
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from compass.infra.disk_full import FullDisk, full_disk_met, full_disk_noted, note_full_disk


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 1 MiB disk of its own (a tmpfs): the ranks' logs and job fit, their first checkpoint does not."""
    if os.geteuid() != 0:
        pytest.fail("a disk of its own is a tmpfs mount, which needs root: run the suite as infra/setup.sh sets it "
                    "up (as root)")
    disk = tmp_path / "disk"
    disk.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "compass-test-disk", str(disk)], check=True)
    try:
        yield disk
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


@pytest.mark.slow
def test_ranks_whose_checkpoint_meets_a_full_disk_end_the_step_on_the_one_message(stage1_job, small_disk: Path):
    from compass.infra.errors import DiskFull
    from compass.tasks.common.training import run_training
    from compass.tasks.steps.execution import disk_full_named

    workdir = small_disk / "work"
    job = stage1_job(workdir, deepspeed=False, data_parallel=2, micro_batch_size=2)
    assert job.world_size == 2  # ranks of their own, started by the launcher: the path under test
    full = r"pretrain:stage1: no space left on the device of .*work.* \([\d,]+ MiB free"
    with pytest.raises(DiskFull, match=full), disk_full_named("pretrain:stage1", workdir):
        run_training(job, logging.getLogger("test"))
    assert not (workdir / "result.json").exists()


def test_torchs_zip_writer_names_no_error_so_the_disk_it_wrote_to_is_looked_at(tmp_path: Path,
                                                                              monkeypatch: pytest.MonkeyPatch):
    """torch.save to a path on a full disk raises "[enforce fail at inline_container.cc] unexpected pos ..." with no
    errno (seen on a full tmpfs here): the failure is the disk's when that disk is nearly full, and not otherwise."""
    from compass.infra import disk_full

    zip_writer = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 576 vs 534")
    assert full_disk_met(zip_writer, tmp_path) is None  # this disk has room: some other failure
    monkeypatch.setattr(disk_full, "NEARLY_FULL_BYTES", 2**62)  # every disk is nearly full at that line
    assert full_disk_met(zip_writer, tmp_path / "checkpoints") == FullDisk(errno.ENOSPC, str(tmp_path / "checkpoints"))
    monkeypatch.undo()
    cause = OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "state.pt"))
    wrapped = RuntimeError("writing a checkpoint failed")
    wrapped.__cause__ = cause  # the checkpoint writer re-raises the write's error from it
    assert full_disk_met(wrapped, tmp_path) == FullDisk(errno.ENOSPC, str(tmp_path / "state.pt"))


def test_a_rank_notes_its_full_disk_for_the_step_and_a_new_attempt_starts_clean(tmp_path: Path):
    from compass.infra.disk_full import clear_full_disk_notes, ended_on_a_full_disk

    ended_on_a_full_disk(tmp_path)  # nothing noted, the disk has room: nothing to say
    note_full_disk(tmp_path, "rank-1", FullDisk(errno.EDQUOT, "/shared/run/work/checkpoints/step-3/state.pt"))
    assert full_disk_noted(tmp_path) == FullDisk(errno.EDQUOT, "/shared/run/work/checkpoints/step-3/state.pt")
    with pytest.raises(OSError) as raised:
        ended_on_a_full_disk(tmp_path)
    assert raised.value.errno == errno.EDQUOT and raised.value.filename.endswith("state.pt")
    clear_full_disk_notes(tmp_path)
    assert full_disk_noted(tmp_path) is None


def test_a_disk_that_fills_before_the_summary_is_written_is_named(small_disk: Path, monkeypatch: pytest.MonkeyPatch):
    """Found by chaos.py (a data step, the disk filled while it committed): the step's summary, written into its
    staging folder after the step's own work, raised a bare OSError with a traceback, retried at once."""
    from compass.flows import runner
    from compass.infra.errors import DiskFull
    from compass.infra.store import Store
    from compass.tasks.steps.context import StepResult
    from tests.test_store import one_step

    def fills_the_disk_then_reports(ctx) -> StepResult:
        with open(small_disk / "ballast", "wb") as ballast:  # what another writer took meanwhile
            os.posix_fallocate(ballast.fileno(), 0, shutil.disk_usage(small_disk).free)
        return StepResult(metrics={"documents": 1}, summary="### a summary of what the step did\n" * 200)

    ctx, step = one_step(small_disk, monkeypatch, fills_the_disk_then_reports)
    ctx = runner.RunContext(ctx.plan, Store(str(small_disk / "store")), ctx.spec_hash, ctx.runtime)
    with pytest.raises(DiskFull, match=r"slow:web: no space left on the device of .*staging.*\([\d,]+ MiB free"):
        runner.run_step(ctx, step, logging.getLogger("test"))
