"""The orchestrator's work per progress tick is flat in the number of steps (issue 73, H4): the live view of a
training step reads only the metrics lines written since its last tick, keeps a bounded series, and publishes its
plot at its own slower cadence, so a weeks-long run costs the login node what a short one does. Before, every tick
re-read and re-parsed the whole metrics file (3.45M rows by the end of SmolLM3's first stage) and redrew every
point into a new artifact version."""

from __future__ import annotations

import json
import tracemalloc
from pathlib import Path
from types import SimpleNamespace

import pytest

from compass.flows.live import PLOT_POINTS, RECENT_ROWS, LiveTraining, MetricsTail
from compass.infra.layout import WorkFolder
from compass.infra.resource_ledger import Ledger, counting


def rows(first: int, last: int, stage_steps: int) -> str:
    return "".join(json.dumps({"step": s, "stage": "stage1", "stage_step": s, "stage_steps": stage_steps,
                               "loss": 3.0 - s / stage_steps, "tokens": 4096 * s, "tokens_per_s": 5000.0}) + "\n"
                   for s in range(first, last + 1))


def follow(tmp_path: Path, steps: int, ticks: int = 30) -> tuple[MetricsTail, int]:
    """A metrics file growing to `steps` rows over `ticks` reads; (the tail, the peak memory of the reads)."""
    path = tmp_path / f"metrics-{steps}.jsonl"
    path.write_text("")
    tail = MetricsTail(path)
    per_tick = steps // ticks
    tracemalloc.start()
    try:
        for tick in range(ticks):
            with open(path, "a") as f:
                f.write(rows(tick * per_tick + 1, (tick + 1) * per_tick, steps))
            tail.read()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return tail, peak


def test_each_tick_reads_only_what_was_written_since_and_keeps_a_bounded_series(tmp_path: Path):
    short, short_peak = follow(tmp_path, 300)
    long, long_peak = follow(tmp_path, 3000)
    for tail, steps in ((short, 300), (long, 3000)):
        assert tail.rows == steps and tail.last.stage_step == steps
        assert tail.bytes_read == tail.path.stat().st_size  # every byte parsed once, none twice
        assert len(tail.series) <= PLOT_POINTS and len(tail.recent) <= RECENT_ROWS
        assert tail.plotted()[0].stage_step == 1 and tail.plotted()[-1].stage_step == steps  # the whole run shown
    # ten times the steps: the same memory kept (the rows held are bounded; what one tick parses is one tick's)
    assert len(long.series) <= PLOT_POINTS and long_peak < 3 * short_peak + 2**20


def test_a_line_being_written_waits_and_a_rewritten_file_is_read_again(tmp_path: Path):
    path = tmp_path / "metrics.jsonl"
    whole = rows(1, 3, 10)
    path.write_text(whole + whole.splitlines()[0][:20])  # the fourth line half-written
    tail = MetricsTail(path)
    assert tail.read() == 3 and tail.read() == 0
    path.write_text(rows(1, 2, 10))  # a resume rewrote it, shorter
    assert tail.read() == 2 and tail.rows == 2 and tail.last.stage_step == 2


@pytest.mark.parametrize("steps", [300, 3000])
def test_the_plot_is_published_at_its_own_cadence_and_every_publication_is_counted(tmp_path: Path,
                                                                                   monkeypatch: pytest.MonkeyPatch,
                                                                                   steps: int):
    """Progress every tick, the plot once per plot_every_s (here: never again within the test) and at the end;
    the step's resource ledger counts each artifact published."""
    import prefect.artifacts

    published: list[str] = []
    monkeypatch.setattr(prefect.artifacts, "create_progress_artifact", lambda **kw: published.append("progress"))
    monkeypatch.setattr(prefect.artifacts, "update_progress_artifact", lambda *a, **kw: published.append("progress"))
    monkeypatch.setattr(prefect.artifacts, "create_markdown_artifact", lambda **kw: published.append("plot"))
    work = WorkFolder(tmp_path / "work")
    work.root.mkdir()
    ledger = Ledger()
    with counting(ledger):
        live = LiveTraining(SimpleNamespace(id="pretrain:stage1"), work.root, "minimal", str(tmp_path), 1, False,
                            __import__("logging").getLogger("test"), "minimal-pretrain-stage1", plot_every_s=3600)
    for tick in range(20):
        with open(work.metrics, "a") as f:
            f.write(rows(tick * steps // 20 + 1, (tick + 1) * steps // 20, steps))
        live._tick(final=tick == 19)
    assert published.count("progress") == 20 and published.count("plot") == 2  # the first tick's and the last
    assert ledger.snapshot().artifacts_published == 22


def _short_steps(steps: int) -> dict[str, str]:
    """The minimal spec's first stage made `steps` optimizer steps of one 32-token sequence, its progress ticking
    every half second and its plot every two."""
    return {"{name: stage1, tokens: 20000, sequence_length: 64, global_batch_size: 4,":
            f"{{name: stage1, tokens: {steps * 32}, sequence_length: 32, global_batch_size: 1,",
            "  parallelism: {micro_batch_size: 2}":
            "  parallelism: {micro_batch_size: 1}\n  monitoring: {progress_every_s: 0.5, plot_every_s: 2}"}


@pytest.mark.slow
def test_a_run_of_3000_steps_keeps_the_orchestrators_memory_of_a_300_step_run(data_store: Path, prefect_server: str,
                                                                              tmp_path: Path):
    """Issue 73's end-to-end check: `compass run` of a stage ten times as long, each in a fresh process (the
    stage trains in the orchestrating process here, the live view beside it), peaks within 10% of the short
    run's resident memory, as its step's resource ledger samples it. It catches anything on the orchestrator's
    path that keeps ~20 KB or more a step (the history, the live series, Prefect's logs); the tick tests above
    catch smaller costs a tick."""
    from compass.infra.resource_ledger import Resources
    from tests.conftest import Cli, base_env, seeded, write_minimal_spec

    ledgers: dict[int, Resources] = {}
    for steps in (300, 3000):
        folder = tmp_path / f"steps-{steps}"
        folder.mkdir()
        spec = write_minimal_spec(folder, **_short_steps(steps))
        store = seeded(folder / "store", data_store)
        env = base_env(folder / "prefect") | {"PREFECT_API_URL": prefect_server}  # the suite's server: no start-up
        Cli(folder, env)("run", str(spec), "--until", "pretrain:stage1", "--store", str(store))
        (manifest,) = store.glob("pretrain/stage1-*/manifest.json")
        recorded = json.loads(manifest.read_text())
        assert recorded["metrics"]["steps"] == steps
        assert sum(1 for _ in (manifest.parent / "metrics.jsonl").open()) >= steps  # the whole history is kept
        ledgers[steps] = Resources.model_validate(recorded["resources"])
    short, long = ledgers[300], ledgers[3000]
    assert short.peak_rss_mb > 100 and long.cpu_s > short.cpu_s  # sampled, and the long run did ten times the work
    assert long.peak_rss_mb <= 1.1 * short.peak_rss_mb, (short.peak_rss_mb, long.peak_rss_mb)
