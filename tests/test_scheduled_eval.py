"""Scheduled evaluation against a real Prefect server: a served deployment whose interval schedule fires,
evaluating exactly the checkpoints without results, nothing on the next run, and new commits after that."""

from __future__ import annotations

import json
import logging
import subprocess
import time
from pathlib import Path

import pytest

from tests.conftest import VENV_BIN, Cli, seeded, stop_group, write_minimal_spec

pytestmark = pytest.mark.slow
SUITE = ("  evaluation:\n    benchmarks:\n      - {name: arc_easy, formulation: cf, limit: 4}\n"
         "    perplexity_sources: [notes]\n  pretraining:")  # the criterion of minimal.yaml is val_ppl:notes


def train(spec_path: Path, store: Path) -> None:
    from compass.flows.compiler import compile_spec
    from compass.flows.runner import RunContext, run_step
    from compass.infra.store import Store
    from compass.specs import load_spec
    from compass.tasks.steps.context import Runtime

    loaded = load_spec(spec_path)
    plan = compile_spec(loaded.spec).restricted_to({"ingest", "curate", "tokenizer", "tokenize", "pretrain"})
    ctx = RunContext(plan, Store(str(store)), loaded.spec_hash,
                     Runtime(how=loaded.spec.how, base_dir=loaded.base_dir))
    for step in plan.steps:
        run_step(ctx, step, logging.getLogger("test"))


def runs(store: Path) -> list[dict]:
    files = sorted(store.glob(".evaluations/*/runs/*.json"))
    return [json.loads(f.read_text()) for f in files]


def wait_for_runs(store: Path, n: int, proc: subprocess.Popen, timeout: float = 300) -> list[dict]:
    deadline = time.monotonic() + timeout
    while len(runs(store)) < n:
        assert proc.poll() is None, "the served deployment exited"
        assert time.monotonic() < deadline, f"only {len(runs(store))} scheduled runs after {timeout}s"
        time.sleep(1)
    return runs(store)


def test_served_schedule_evaluates_each_checkpoint_once(server_cli: Cli, trained_store: Path, tmp_path: Path):
    store = seeded(tmp_path / "store", trained_store)  # two stages trained: two checkpoints to evaluate
    spec = write_minimal_spec(tmp_path, **{"  pretraining:": SUITE})
    train(spec, store)
    proc = subprocess.Popen([str(VENV_BIN / "compass"), "evaluate-schedule", str(spec), "--root", str(store),
                             "--interval", "5"], cwd=tmp_path, env=server_cli.env, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        first, second = wait_for_runs(store, 2, proc)[:2]
        assert first["checkpoints"] == 2  # stage1 and stage2 (each stage's final equals its last checkpoint)
        assert {c["step"] for c in first["evaluated"]} == {"pretrain:stage1", "pretrain:stage2"}
        assert second["evaluated"] == []  # nothing new: nothing evaluated
        results = list(store.glob(".evaluations/*/*.json"))
        assert len(results) == 2
        record = json.loads(results[0].read_text())
        assert 0 <= record["metrics"]["arc_easy:cf/acc"] <= 1

        # a checkpoint committed while the deployment is running is picked up by a later run (a longer last
        # stage: the stable stage before it stays cached)
        retrained = write_minimal_spec(tmp_path, **{"  pretraining:": SUITE,
                                                    "{name: stage2, tokens: 10000,": "{name: stage2, tokens: 12000,"})
        train(retrained, store)
        count = len(runs(store))
        later = wait_for_runs(store, count + 1, proc)[count:]
        new = [c for r in later for c in r["evaluated"]]
        assert [c["step"] for c in new] == ["pretrain:stage2"]
        assert len(list(store.glob(".evaluations/*/*.json"))) == 3
    finally:
        stop_group(proc)

    # `--once` on a terminal: a checkpoint whose result went away is evaluated now and its scores are what it
    # prints; the libraries' progress bars, warnings and logs are in the log file it names
    result = sorted(store.glob(".evaluations/*/*.json"))[0]
    record = json.loads(result.read_text())
    result.unlink()
    done = server_cli("evaluate-schedule", str(spec), "--root", str(store), "--once")
    shown = done.stdout.splitlines()
    assert shown[0].startswith("3 checkpoints, 1 evaluated now (suite ")
    assert shown[1].startswith(f"  {record['checkpoint']['step']} {record['checkpoint']['folder']}: ")
    assert f"arc_easy:cf/acc {record['metrics']['arc_easy:cf/acc']:.4g}" in shown[1] and len(shown) == 2
    assert "it/s]" not in done.stderr and "LOAD_" not in done.stderr and len(done.stderr.splitlines()) < 25
    log = done.stderr.splitlines()[0].split(": ", 1)[1]
    assert "max_samples WAS SET" in (server_cli.cwd / log).read_text()  # lighteval's warning: left out, kept
