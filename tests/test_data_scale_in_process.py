"""Small local data stages run their datatrove ranks in the step's own process (no pool of workers to start), one
at a time: datatrove's task logger resets loguru's global sinks, so two at once would write into each other's
logs. how.orchestration.in_process_below_mib: 0 keeps the pool."""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path

from datatrove.pipeline.base import PipelineStep

from compass.specs.how import CONTENT_BYTE_COST, How
from compass.tasks.data.datatrove_stages import run_stage
from compass.tasks.steps.backends.local import WORKER_MODULES
from compass.tasks.steps.context import Runtime


class RecordRank(PipelineStep):
    """Writes the process that ran each rank and logs a few lines through datatrove's logger."""

    name = "record rank"

    def __init__(self, folder: str, label: str, pause_s: float = 0.0):
        super().__init__()
        self.folder, self.label, self.pause_s = folder, label, pause_s

    def run(self, data=None, rank: int = 0, world_size: int = 1):
        from loguru import logger

        Path(self.folder, f"{rank}.pid").write_text(str(os.getpid()))
        for line in range(5):
            logger.info(f"{self.label} rank {rank} line {line}")
            time.sleep(self.pause_s)
        yield from data or []


def runtime(in_process_below_mib: float) -> Runtime:
    return Runtime(how=How.model_validate({"orchestration": {"workers": 2,
                                                             "in_process_below_mib": in_process_below_mib}}))


def pids(folder: Path) -> set[int]:
    return {int(p.read_text()) for p in folder.glob("*.pid")}


def test_a_small_stage_runs_its_ranks_here_and_a_pool_when_turned_off(tmp_path: Path):
    log = logging.getLogger("test")
    here, pool = tmp_path / "here", tmp_path / "pool"
    here.mkdir(), pool.mkdir()
    run_stage(runtime(4), "small", tmp_path / "logs", [RecordRank(str(here), "small")], 2, log, input_bytes=1000)
    assert pids(here) == {os.getpid()} and len(list(here.glob("*.pid"))) == 2
    run_stage(runtime(0), "pooled", tmp_path / "logs", [RecordRank(str(pool), "pooled")], 2, log, input_bytes=1000)
    assert len(list(pool.glob("*.pid"))) == 2 and os.getpid() not in pids(pool)


def test_two_in_process_stages_at_once_keep_their_own_task_logs(tmp_path: Path):
    log = logging.getLogger("test")
    errors: list[BaseException] = []

    def stage(label: str) -> None:
        try:
            (tmp_path / label).mkdir()
            run_stage(runtime(4), label, tmp_path / "logs", [RecordRank(str(tmp_path / label), label, 0.05)], 1,
                      log, input_bytes=10)
        except BaseException as exc:  # noqa: BLE001 - reported by the assertion below
            errors.append(exc)

    threads = [threading.Thread(target=stage, args=(label,)) for label in ("alpha", "beta")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    for label, other in (("alpha", "beta"), ("beta", "alpha")):
        text = (tmp_path / "logs" / label / "logs" / "task_00000.log").read_text()
        assert all(f"{label} rank 0 line {i}" in text for i in range(5)), text
        assert other not in text, text


class LoadedModules(PipelineStep):
    """Writes which of the data path's worker modules, and whether torch, a rank's process had loaded when it ran."""

    name = "loaded modules"

    def __init__(self, folder: str):
        super().__init__()
        self.folder = folder

    def run(self, data=None, rank: int = 0, world_size: int = 1):
        import json
        import sys

        loaded = [name for name in WORKER_MODULES if name in sys.modules]
        Path(self.folder, f"{rank}.json").write_text(json.dumps({"loaded": loaded, "torch": "torch" in sys.modules}))
        yield from data or []


def test_pool_workers_start_with_the_data_blocks_modules_already_imported(tmp_path: Path):
    """The forkserver imports the data blocks' modules once; without that every worker of every stage imported
    them itself (~0.5 s a stage). None of them pulls in torch."""
    import json

    run_stage(runtime(0), "pooled", tmp_path / "logs", [LoadedModules(str(tmp_path))], 2, logging.getLogger("test"))
    ranks = [json.loads((tmp_path / f"{rank}.json").read_text()) for rank in range(2)]
    assert [r["loaded"] for r in ranks] == [list(WORKER_MODULES)] * 2
    assert not any(r["torch"] for r in ranks)


def test_a_costly_pass_over_the_same_bytes_gets_a_pool(tmp_path: Path):
    """A content-filtering pass costs ~100x a copy per byte: 100 KiB of input runs here as a copy and in a pool of
    workers as a pass of curation's filters."""
    log = logging.getLogger("test")
    copy, costly = tmp_path / "copy", tmp_path / "costly"
    copy.mkdir(), costly.mkdir()
    run_stage(runtime(4), "copy", tmp_path / "logs", [RecordRank(str(copy), "copy")], 2, log, input_bytes=100 << 10)
    run_stage(runtime(4), "costly", tmp_path / "logs", [RecordRank(str(costly), "costly")], 2, log,
              input_bytes=100 << 10, cost_per_byte=CONTENT_BYTE_COST)
    assert pids(copy) == {os.getpid()}
    assert len(list(costly.glob("*.pid"))) == 2 and os.getpid() not in pids(costly)
