"""Every checkpoint the spec asks to evaluate is announced to the checkpoint-event evaluation, also those written
while no orchestrator watched, and also once keep_last moved its export to evaluation-pending/ (the Slurm test of
the whole path, two orchestrators killed mid-stage and every checkpoint scored once, is in test_placement_slurm)."""

from __future__ import annotations

import logging
from pathlib import Path
from types import SimpleNamespace

from compass.flows.live import LiveTraining
from compass.infra.layout import WEIGHTS, WorkFolder
from compass.model.training import checkpoints as ckpt


def checkpoint(work: WorkFolder, step: int) -> str:
    """A complete checkpoint with an export; the sha256 of its weights."""
    tmp = work.checkpoints / f"step-{step:08d}.tmp"
    (tmp / "hf").mkdir(parents=True)
    (tmp / "hf" / WEIGHTS).write_bytes(bytes([step]) * 32)
    (tmp / "state.pt").write_bytes(b"state")
    ckpt.finalize(tmp, ckpt.step_dir(work.checkpoints, step))
    return ckpt.sha256_file(str(work.checkpoint(step).hf / WEIGHTS))


def test_a_new_orchestrator_announces_the_checkpoints_written_while_none_watched(tmp_path: Path, monkeypatch):
    work = WorkFolder(tmp_path / "work")
    shas = {step: checkpoint(work, step) for step in (10, 20, 30)}
    ckpt.prune(work.checkpoints, keep_last=1, keep=set(), pending=work.evaluation_pending)  # 10, 20 pending
    live = LiveTraining(SimpleNamespace(id="pretrain:stage1"), work.root, "minimal", str(tmp_path / "store"),
                        every_s=3600, events=True, log=logging.getLogger("test"), key="minimal-pretrain-stage1")
    announced: list[tuple[str, str, str]] = []
    monkeypatch.setattr(live, "_announce", lambda path, name, sha, tokens: announced.append((name, sha, path)))
    with live:  # a restarted orchestrator: the stage's job trained on while none watched
        live._tick()
        live._tick()  # each once
    assert [(name, sha) for name, sha, _ in announced] == [(f"step-{s:08d}", shas[s]) for s in (10, 20, 30)]
    assert all(Path(path, WEIGHTS).exists() for _, _, path in announced)  # where each export is now
