"""End to end through the CLI against a real Prefect server: run, cached re-run, one-field changes,
plan reasons, lineage, and the artifacts the UI shows."""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, Cli, prefect_client, seeded, settled_task_runs, write_minimal_spec
from tests.shards import SHARD_SUFFIX, shard_records

pytestmark = pytest.mark.slow


UI_NAME = {"name: minimal": "name: minimal-ui"}


def executed(summary: dict) -> set[str]:
    return {s["step"] for s in summary["steps"] if s["executed"]}


def read_ids(folder: Path) -> set[str]:
    ids = set()
    for shard in folder.glob("*" + SHARD_SUFFIX):
        ids |= {record["id"] for record in shard_records(shard)}
    return ids


def quiet_terminal(terminal: str, steps: set[str], cwd: Path) -> None:
    """The terminal holds compass's lines (each step's start, its commit with key numbers, training progress);
    datatrove's logs, progress bars and library warnings are in the run's log file, named on the first line."""
    first, *lines = terminal.splitlines()
    assert first.startswith("everything else the run prints: .compass/logs/minimal-"), first
    for step in steps:
        assert any(f"{step} running; commits to" in line for line in lines), step
        assert any(f"{step} committed to" in line for line in lines), step
    assert any("curate:notes committed to" in line and "documents_in 44, documents_out 40" in line for line in lines)
    assert any("pretrain:stage1: step" in line and "tokens/s" in line for line in lines)  # its progress line
    counted = [line for line in lines if re.search(rf"\[\d+/{len(steps)}\] \S+ done: \d+ ran, \d+ cached", line)]
    assert len(counted) == len(steps) and f"[{len(steps)}/{len(steps)}]" in counted[-1]  # how far the run is
    assert all("left in the run" in line for line in counted[:-1]) and "left in the run" not in counted[-1]
    assert not [line for line in lines if "datatrove" in line or "it/s]" in line or "Launching pipeline" in line]
    assert len(lines) < 5 * len(steps) + 12, terminal  # a few lines per step, not hundreds
    log = (cwd / first.split(": ", 1)[1].split(" (")[0]).read_text()
    assert "datatrove" in log and "Launching pipeline" in log  # what the terminal left out is kept


def test_run_cache_and_one_field_changes(server_cli: Cli, tmp_path: Path, prefect_server: str):
    spec = write_minimal_spec(tmp_path, **{"how:\n": "how:\n  monitoring: {progress_every_s: 3}\n",  # progress lines
                                           "name: minimal": "name: minimal-ui"})  # its own artifacts on the server
    store = tmp_path / "store"
    data_steps = {"ingest:notes", "curate:notes", "ingest:code", "curate:code"}
    trained = {"tokenize:notes", "tokenize:code", "pretrain:stage1", "pretrain:stage2"}
    all_steps = data_steps | {"tokenizer:select"} | trained

    done = server_cli("run", str(spec), "--store", str(store), "--json")
    first = json.loads(done.stdout)
    assert executed(first) == all_steps
    assert first["left_out"] == []  # no --until: every step of the plan is in the run
    quiet_terminal(done.stderr, all_steps, server_cli.cwd)

    # two stages trained, the second continuing the first; the final checkpoint loads in transformers
    stage1 = json.loads(next(store.glob("pretrain/stage1-*/manifest.json")).read_text())["metrics"]
    stage2 = json.loads(next(store.glob("pretrain/stage2-*/manifest.json")).read_text())["metrics"]
    assert stage1["final_loss"] < stage1["first_loss"]
    assert abs(stage2["first_loss"] - stage1["final_loss"]) < 0.5 * (stage1["first_loss"] - stage1["final_loss"])
    from transformers import AutoModelForCausalLM

    final = next(store.glob("pretrain/stage2-*/final"))
    assert AutoModelForCausalLM.from_pretrained(str(final)).config.model_type == "smollm3"
    from compass.tasks.common.plots import PlotDescription

    (panel,) = PlotDescription.read(final.parent / "loss.png").panels  # the loss drawn is the loss logged
    rows = [json.loads(line) for line in (final.parent / "metrics.jsonl").read_text().splitlines()]
    assert panel.ylabel == "training loss" and panel.xlabel == "tokens seen"
    assert {s.label: (list(s.x), list(s.y)) for s in panel.series if not s.label.endswith(" (smoothed)")} == {
        stage: ([r["tokens"] for r in rows if r["stage"] == stage], [r["loss"] for r in rows if r["stage"] == stage])
        for stage in dict.fromkeys(r["stage"] for r in rows)}
    assert panel.outside == []

    # curation removed exactly what was planted: 2 exact copies, 1 near copy, 1 French note
    curated = next(store.glob("curate/notes-*"))
    stats = json.loads((curated / "stats.json").read_text())
    assert stats["before"]["documents"] == 44
    removed = stats["removed_by"]
    assert removed["exact_dedup"] == 2 and removed["minhash_dedup"] == 1
    assert sum(removed.values()) == 4  # and the French note, by a quality or the language filter
    kept = read_ids(curated / "train") | read_ids(curated / "heldout")
    assert len(kept) == 40
    assert not {"notes/note40.txt#0", "notes/note41.txt#0", "notes/note43.txt#0"} & kept
    assert len({"notes/note02.txt#0", "notes/note42.txt#0"} & kept) == 1  # MinHash kept one of the pair

    record = tmp_path / "cached-run.json"  # the model libraries the cached re-run's process imported
    cached = subprocess.run([sys.executable, "-m", "tests.watched_cli", str(record), "run", str(spec), "--store",
                             str(store), "--json"], cwd=REPO, env=server_cli.env, capture_output=True, text=True,
                            timeout=600)
    assert cached.returncode == 0, cached.stderr[-3000:]
    assert executed(json.loads(cached.stdout)) == set()
    assert json.loads(record.read_text())["heavy_modules"] == []  # finding everything committed loads no model code
    artifacts_and_task_runs_reached_the_server(prefect_server)

    # one tokenizer field: only the tokenizer and what it feeds re-run; plan says why. (The later runs stop at the
    # tokenizer: the first run trained already, and the plan's reasons show what training would re-run.)
    spec = write_minimal_spec(tmp_path, **{"train_chars: 100000": "train_chars: 80000", **UI_NAME})
    plan = server_cli.json("plan", str(spec), "--store", str(store))
    dag = {row[0]: row for row in plan["sections"][0]["rows"]}
    assert dag["tokenizer:select"][3:5] == ["run", "config changed: train_chars 100000 -> 80000"]
    assert dag["curate:notes"][3] == "cached"
    assert {step for step, row in dag.items() if row[3] == "run"} == {"tokenizer:select"} | trained
    assert dag["tokenize:notes"][4] == "input changed: tokenizer:select"
    until_tokenizer = ("--until", "tokenizer:select")
    assert executed(server_cli.json("run", str(spec), "--store", str(store), *until_tokenizer)) == {
        "tokenizer:select"}

    # one curation field of one source: that curation and its descendants re-run, nothing else
    spec = write_minimal_spec(tmp_path, **{"train_chars: 100000": "train_chars: 80000", **UI_NAME,
                                           "curation: {heldout_fraction: 0.2}": "curation: {heldout_fraction: 0.25}"})
    plan = server_cli.json("plan", str(spec), "--store", str(store))
    dag = {row[0]: row for row in plan["sections"][0]["rows"]}
    assert dag["curate:code"][4] == "config changed: curation.heldout_fraction 0.2 -> 0.25"
    assert dag["tokenizer:select"][4] == "input changed: curate:code"
    assert {step for step, row in dag.items() if row[3] == "run"} == {"curate:code", "tokenizer:select"} | trained
    assert executed(server_cli.json("run", str(spec), "--store", str(store), *until_tokenizer)) == {
        "curate:code", "tokenizer:select"}

    # orchestration settings are not part of any fingerprint
    spec = write_minimal_spec(tmp_path, **{"train_chars: 100000": "train_chars: 80000", **UI_NAME,
                                           "curation: {heldout_fraction: 0.2}": "curation: {heldout_fraction: 0.25}",
                                           "parallelism: {micro_batch_size: 2}":
                                           "parallelism: {micro_batch_size: 2}\n  orchestration: {retries: 4}"})
    assert executed(server_cli.json("run", str(spec), "--store", str(store), *until_tokenizer)) == set()

    # a local tokenizer folder competes as a candidate next to freshly trained ones
    previous = next(store.glob("tokenizer/select-*")) / "chosen"
    spec = write_minimal_spec(tmp_path, **UI_NAME, **{"      - {kind: bpe, vocab_size: 400}":
                                           f"      - {{kind: bpe, vocab_size: 400}}\n"
                                           f"      - {{kind: local, name: earlier, path: '{previous}'}}"})
    assert executed(server_cli.json("run", str(spec), "--store", str(store), *until_tokenizer)) == {
        "tokenizer:select"}
    newest = max(store.glob("tokenizer/select-*/comparison.json"), key=lambda p: p.stat().st_mtime)
    candidates = {r["candidate"] for r in json.loads(newest.read_text())["results"]}
    assert candidates == {"bpe-300", "bpe-400", "earlier"}

    # lineage from a file of the chosen tokenizer back to both raw sources
    chosen = newest.parent / "chosen" / "tokenizer.json"
    tree = server_cli.json("lineage", str(chosen))
    assert tree["step"] == "tokenizer:select"
    raw = {c["inputs"][0]["step"]: c["inputs"][0]["provenance"] for c in tree["inputs"]}
    assert set(raw) == {"ingest:notes", "ingest:code"}
    assert raw["ingest:notes"][0]["kind"] == "local"
    text = server_cli("lineage", str(chosen)).stdout
    assert "ingest:notes" in text and "curate:code" in text


def artifacts_and_task_runs_reached_the_server(prefect_server: str) -> None:
    """The run's task runs and artifacts, as the UI shows them: after a run and its cached re-run."""

    async def query():
        from prefect.client.orchestration import get_client
        from prefect.client.schemas.filters import (
            ArtifactFilter,
            ArtifactFilterKey,
            FlowRunFilter,
            FlowRunFilterName,
        )

        async with get_client() as client:
            runs = await client.read_flow_runs(
                flow_run_filter=FlowRunFilter(name=FlowRunFilterName(like_="minimal-ui")))
            tasks = await client.read_task_runs(flow_run_filter=FlowRunFilter(id={"any_": [runs[0].id]}))
            keys = ["minimal-ui-plan", "minimal-ui-tokenizer-select", "minimal-ui-tokenizer-comparison-select",
                    "minimal-ui-curation-notes"]
            arts = await client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=keys)))
            return runs, tasks, arts

    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings({PREFECT_API_URL: prefect_server}):
        runs, tasks, arts = asyncio.run(query())
    assert runs and runs[0].state.is_completed()
    assert {t.name for t in tasks} >= {"ingest:notes", "curate:notes", "tokenizer:select"}
    assert all(t.state.is_completed() for t in tasks)
    by_key = {a.key: a for a in arts}
    assert set(by_key) == {"minimal-ui-plan", "minimal-ui-tokenizer-select", "minimal-ui-tokenizer-comparison-select",
                           "minimal-ui-curation-notes"}
    assert by_key["minimal-ui-tokenizer-comparison-select"].type == "table"
    assert "Training compute" in by_key["minimal-ui-plan"].data

    # a cached re-run publishes each step's summary again, with its plots inlined for the UI
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey
    from prefect.client.schemas.sorting import ArtifactSort

    with prefect_client(prefect_server) as client:
        first, again = sorted(client.read_artifacts(
            artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=["minimal-ui-pretrain-stage1"])),
            sort=ArtifactSort.CREATED_DESC, limit=2), key=lambda a: a.created)
    assert "cached: committed earlier" in again.data and "cached" not in first.data
    summary = first.data.split("**output**")[0].strip()
    assert summary and summary in again.data
    assert "![loss.png](data:image/png;base64," in again.data


def busiest_thread(pid: int) -> int:
    """The thread of `pid`, other than its main thread, that has used the most CPU (a training step's)."""
    def cpu(task: Path) -> int:
        fields = task.joinpath("stat").read_text().rsplit(")", 1)[1].split()
        return int(fields[11]) + int(fields[12])  # utime + stime

    tasks = [t for t in Path(f"/proc/{pid}/task").iterdir() if int(t.name) != pid]
    return int(max(tasks, key=cpu).name)


def signal_thread(pid: int, tid: int, signum: int) -> None:
    """tgkill(2): a signal to one thread of another process (os.kill picks the thread itself)."""
    import ctypes
    import platform

    number = {"x86_64": 234, "aarch64": 131}[platform.machine()]
    assert ctypes.CDLL(None, use_errno=True).syscall(number, pid, tid, signum) == 0, ctypes.get_errno()


def test_sigterm_mid_training_ends_the_run_and_keeps_what_was_committed(server_cli: Cli, prefect_server: str,
                                                                         data_store: Path, tmp_path: Path):
    """Prefect turns SIGTERM into an exception in the main thread, but the training step runs in a worker
    thread: the run must end without finishing (or committing) that step, record its state on the server, and
    lose nothing committed. The signal is sent to the training thread itself (the kernel may deliver a SIGTERM
    to any thread): the main thread must still notice it at once."""
    import signal
    import subprocess
    import time

    from prefect.client.schemas.filters import FlowRunFilter

    from compass.specs import load_spec
    from tests.conftest import VENV_BIN

    spec = write_minimal_spec(tmp_path, **{"tokens: 20000": "tokens: 400000"})  # a stage long enough to stop
    store = seeded(tmp_path / "store", data_store)
    log = tmp_path / "run.log"
    with log.open("w") as out:
        proc = subprocess.Popen([str(VENV_BIN / "compass"), "run", str(spec), "--store", str(store)],
                                cwd=tmp_path, env=server_cli.env, stdout=out, stderr=subprocess.STDOUT)
    try:
        while "pretrain:stage1 running" not in log.read_text():
            assert proc.poll() is None, log.read_text()[-3000:]
            time.sleep(0.2)
        time.sleep(1)  # inside the training step
        signal_thread(proc.pid, busiest_thread(proc.pid), signal.SIGTERM)
        assert proc.wait(timeout=300) == 143, log.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
    assert "interrupted (TerminationSignal)" in log.read_text()
    assert "Traceback" not in log.read_text(), log.read_text()[-5000:]  # one message, not a thread's traceback
    committed = {p.parent.parent.name + ":" + p.parent.name.rsplit("-", 1)[0] for p in store.glob("*/*/manifest.json")}
    assert {"curate:notes", "curate:code", "tokenizer:select", "tokenize:notes"} <= committed
    assert not any(c.startswith("pretrain:") for c in committed)  # the step in flight never committed

    name = f"minimal-{load_spec(spec).spec_hash[:8]}"
    with prefect_client(prefect_server) as client:
        (run,) = client.read_flow_runs(flow_run_filter=FlowRunFilter(name={"any_": [name]}))
    tasks = {n: t.state.type.value for n, t in settled_task_runs(
        prefect_server, run.id, {"pretrain:stage1", "tokenizer:select"}).items()}
    assert run.state.type.value == "CRASHED" and "interrupted" in run.state.message
    assert tasks["pretrain:stage1"] == "CRASHED" and tasks["tokenizer:select"] == "COMPLETED"
