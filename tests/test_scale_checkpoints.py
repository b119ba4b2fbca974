"""What a training step sends to a remote store grows with what it writes, not with how long it runs (issue 73, M2):
the checkpoint mirror uploads each completed checkpoint once and the metrics file as append-only parts beside them,
so a stage's metrics reach the store once in all; before, the whole file went up every 2 s for weeks (~1.4 GB by
the end of SmolLM3's first stage, thousands of times). A pass that finds nothing new sends and lists nothing."""

from __future__ import annotations

import json
from pathlib import Path

from compass.infra.checkpoint_mirror import METRIC_PARTS, CheckpointMirror
from compass.infra.layout import CHECKSUMS, WorkFolder, checkpoint_name
from compass.infra.resource_ledger import Ledger, counting
from compass.infra.store import Store


def metrics_lines(first: int, last: int) -> str:
    return "".join(json.dumps({"step": s, "stage": "stage1", "loss": 1.0, "tokens": 64 * s}) + "\n"
                   for s in range(first, last + 1))


def checkpoint(work: WorkFolder, step: int) -> None:
    folder = work.checkpoints / checkpoint_name(step)
    folder.mkdir(parents=True)
    (folder / "state.bin").write_bytes(b"x" * 1000)
    (folder / CHECKSUMS).write_text("{}")


def run_stage(tmp_path: Path, checkpoints: int, steps_between: int = 100) -> tuple[int, int, WorkFolder, Store]:
    """A stage writing `checkpoints` checkpoints, the mirror passing ten times between two; (metrics bytes sent,
    the metrics file's size, the work folder, the store)."""
    store = Store(str(tmp_path / f"remote-{checkpoints}"))
    work = WorkFolder(tmp_path / f"work-{checkpoints}")
    work.checkpoints.mkdir(parents=True)
    ledger = Ledger()
    with counting(ledger):
        mirror = CheckpointMirror(store, "pretrain/stage1-abcdef012345", work.checkpoints)
    sent_before_metrics = 0
    for c in range(checkpoints):
        with open(work.metrics, "a") as f:
            f.write(metrics_lines(c * steps_between + 1, (c + 1) * steps_between))
        checkpoint(work, (c + 1) * steps_between)
        for _ in range(10):  # the thread's passes: only the first after a checkpoint finds anything
            mirror.sync_once()
        sent_before_metrics += 1000 + 2  # the checkpoint's files
    mirror.sync_once(final=True)
    return ledger.snapshot().uploaded - sent_before_metrics, work.metrics.stat().st_size, work, store


def test_the_metrics_go_up_once_in_parts_however_many_checkpoints(tmp_path: Path):
    for checkpoints in (3, 30):
        sent, size, work, store = run_stage(tmp_path, checkpoints)
        assert sent == size  # every byte of the metrics once: linear in the run, not in passes or checkpoints
        parts = sorted((Path(store.root_path) / ".work" / "pretrain" / "stage1-abcdef012345" / METRIC_PARTS).iterdir())
        assert len(parts) == checkpoints and b"".join(p.read_bytes() for p in parts) == work.metrics.read_bytes()


def test_a_fresh_machine_restores_the_newest_checkpoint_with_the_whole_metrics(tmp_path: Path):
    _, _, work, store = run_stage(tmp_path, 3)
    fresh = WorkFolder(tmp_path / "fresh")
    fresh.checkpoints.mkdir(parents=True)
    restored = CheckpointMirror(store, "pretrain/stage1-abcdef012345", fresh.checkpoints).restore()
    assert restored == checkpoint_name(300)
    assert fresh.metrics.read_bytes() == work.metrics.read_bytes()
