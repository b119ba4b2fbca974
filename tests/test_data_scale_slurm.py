"""Curation and tokenization on a real one-node Slurm cluster run as datatrove Slurm job arrays (its
SlurmPipelineExecutor) from one-CPU driver jobs: every stage is an array of the data phase's tasks, or, beyond the
cluster's MaxArraySize (2 here), several arrays submitted together; an array task cancelled mid-array fails the
step, and the relaunch redoes only that task (datatrove's completion markers in the step's work folder) while the
finished ones are not run again; the curated shards and the token shards equal an in-process run's bit for bit."""

from __future__ import annotations

import json
import logging
import random
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from compass.infra.layout import SPLITS
from compass.infra.store import Store
from tests.conftest import FIXTURES, REPO, VENV_BIN, base_env, running_cluster
from tests.watching import Watch

pytestmark = pytest.mark.slow
MAX_ARRAY = 2  # the cluster's MaxArraySize: a stage of 3 tasks is two arrays


@pytest.fixture(scope="module")
def slurm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """A one-node cluster whose job arrays hold MAX_ARRAY tasks at most."""
    with running_cluster(tmp_path_factory.mktemp("slurm"), max_array_size=MAX_ARRAY) as env:
        yield env
SHARDS = 3  # ingest writes 500 documents per shard: 1,200 documents make three tasks per stage

SPEC = """name: arrays
why: {reason: research, question: Does curation run as Slurm job arrays?, hypothesis: Every stage is an array,
      success_criteria: [{metric: "val_ppl:web", op: "<=", threshold: 1000, checkpoint: final}]}
what:
  architecture: {num_layers: 2, hidden_size: 64, ffn_size: 128, num_heads: 4, num_kv_heads: 2,
                 positions: {kind: rope, rope_theta: 10000}}
  tokenizer: {candidates: [{kind: bpe, vocab_size: 300}], train_chars: 100000, eval_chars: 20000}
  data:
    sources:
      - name: web
        uri: SOURCE
        include: ["*.txt"]
        format: text
        language: en
        domain: web
        curation:
          filters: [{name: gopher_repetition}, {name: gopher_quality, params: {min_doc_words: 20}}]
          exact_dedup: true
          heldout_fraction: 0.2
  pretraining:
    schedule: {kind: wsd, warmup_steps: 2}
    stages: [{name: stage1, tokens: 20000, sequence_length: 64, global_batch_size: 4, mixture: {web: 1.0}}]
how:
  parallelism: {micro_batch_size: 2}
  resources: {data: {cpus_per_node: 1}}
  orchestration: {retries: 0, cluster: {kind: slurm, poll_seconds: 0.5, shared_root: SHARED}}
"""


def _source(folder: Path) -> Path:
    """1,200 documents of the fixture notes' words (a few exact duplicates, for the dedup stage to find): prose
    that passes the quality filters, and fixed (the README's words changed with the README)."""
    words = " ".join(p.read_text() for p in sorted((FIXTURES / "corpus" / "en").glob("*.txt"))).split()
    rng = random.Random(0)
    folder.mkdir()
    texts = [" ".join(rng.choice(words) for _ in range(rng.randint(40, 120))) for _ in range(1190)]
    for i, text in enumerate(texts + texts[:10]):
        (folder / f"doc{i:05d}.txt").write_text(text)
    return folder


def _queued(name: str) -> list[str]:
    out = subprocess.run(["squeue", "-h", "-r", "-n", name, "-o", "%i %T"], capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if line.strip()]


class DependencyWatch(Watch):
    """Polls the queue in a thread while a run goes on, keeping each array job's name and the dependency it waited
    on while pending: an array launched in a wave after another waits on `afterany:<the other>` while that one runs
    (over a second: each task starts python and datatrove), far longer than the poll interval."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: dict[str, set[str]] = {}

    def sample(self) -> None:
        out = subprocess.run(["squeue", "-h", "-r", "-o", "%j|%E"], capture_output=True, text=True).stdout
        for name, dependency in (line.split("|", 1) for line in out.splitlines() if "|" in line):
            if name.startswith("compass-arrays-"):
                self.seen.setdefault(name, set()).add(dependency.strip())


def _array_tasks(slurm: dict[str, str], name: str) -> list[dict[str, str]]:
    """The array tasks named `name` the controller finished (jobcomp/filetxt), in the order they ended."""
    log = Path(slurm["SLURM_CONF"]).with_name("jobcomp.log")
    jobs = [dict(f.split("=", 1) for f in line.split() if "=" in f) for line in log.read_text().splitlines()]
    return [j for j in jobs if j.get("Name") == name]


def launched(ranks: int) -> int:
    """Array tasks a stage of `ranks` ranks submits: beyond MAX_ARRAY, datatrove's arrays are all MAX_ARRAY long
    (the last one's extra tasks find no rank and end at once)."""
    return ranks if ranks <= MAX_ARRAY else -(-ranks // MAX_ARRAY) * MAX_ARRAY


def _files(store: Path, kind: str) -> dict[str, str]:
    (manifest,) = store.glob(f"{kind}/web-*/manifest.json")
    return {f["path"]: f["sha256"] for f in json.loads(manifest.read_text())["files"]}


def test_data_steps_run_as_slurm_arrays_redo_only_a_cancelled_task_and_equal_a_local_run(
        slurm, prefect_server: str, tmp_path: Path):
    from compass.flows.compiler import compile_spec
    from compass.flows.runner import run_in_process
    from compass.specs import load_spec
    from compass.tasks.steps.context import Runtime

    text = SPEC.replace("SOURCE", str(_source(tmp_path / "web"))).replace("SHARED", str(tmp_path / "shared"))
    spec = tmp_path / "spec.yaml"
    spec.write_text(text)
    local_spec = tmp_path / "local.yaml"
    here = [line for line in text.splitlines() if not line.startswith(("  orchestration", "  resources"))]
    local_spec.write_text("\n".join(here))  # the same spec on this machine
    loaded = load_spec(local_spec)
    plan = compile_spec(loaded.spec)
    run_in_process(plan.restricted_to({"ingest", "curate", "tokenizer", "tokenize"}), Store(str(tmp_path / "local")),
                   loaded.spec_hash, Runtime(how=loaded.spec.how, base_dir=loaded.base_dir),
                   logging.getLogger("test"))

    store = tmp_path / "store"
    env = base_env(tmp_path / "prefect") | {"PREFECT_API_URL": prefect_server}
    argv = [str(VENV_BIN / "compass"), "run", str(spec), "--store", str(store),
            "--until", "tokenize:web"]
    first = subprocess.Popen(argv, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 600
    def second_task() -> str | None:  # rank 1: the first array's second task, pending behind its first (%1)
        return next((line.split()[0] for line in _queued("compass-arrays-filter")
                     if line.split()[0].endswith("_1")), None)

    while not (task := second_task()):
        assert first.poll() is None, first.stdout.read()[-4000:]
        assert time.monotonic() < deadline, "no filter array was submitted"
        time.sleep(0.2)
    subprocess.run(["scancel", task], check=True)  # one task of the array, before it ran
    out, _ = first.communicate(timeout=900)
    said = " ".join(out.split())
    assert first.returncode != 0 and "finished without ranks [1] of 3" in said, said[-4000:]
    assert not any(store.glob("curate/web-*/manifest.json"))
    done = {j["JobId"] for j in _array_tasks(slurm, "compass-arrays-filter") if j["JobState"] == "COMPLETED"}
    assert len(done) == launched(SHARDS) - 1  # the cancelled task never ran

    with DependencyWatch() as watch:
        second = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert second.returncode == 0, second.stdout[-2000:] + second.stderr[-4000:]
    # the cancelled task's own record (CANCELLED, written whenever the controller gets to it) is not a redone task
    redone = [j for j in _array_tasks(slurm, "compass-arrays-filter")
              if j["JobId"] not in done and j["JobState"] != "CANCELLED"]
    assert len(redone) == 1 and redone[0]["JobState"] == "COMPLETED", redone  # only the cancelled task, once
    said = " ".join((second.stdout + second.stderr).split())
    assert "stage filter: Slurm array" in said and " of 1 tasks" in said, said[-4000:]
    curated = _files(store, "curate")
    later = {"exact-signature": SHARDS, "split": SHARDS,  # one task per shard (exact dedup's filter: in the split)
             **{f"tokenize-{split}": sum(p.startswith(f"{split}/") for p in curated) for split in SPLITS}}
    for stage, n in later.items():
        tasks = _array_tasks(slurm, f"compass-arrays-{stage}")
        assert n > 0 and len(tasks) == launched(n) and len({t["JobId"] for t in tasks}) == len(tasks), (stage, tasks)
        assert all(t["JobState"] == "COMPLETED" for t in tasks)
        firsts = [t for t in tasks if t["ArrayTaskId"] == "0"]
        assert len(firsts) == -(-n // MAX_ARRAY), (stage, tasks)  # the stage's arrays, launched together:
        assert watch.seen.get(f"compass-arrays-{stage}") == {"(null)"}, watch.seen  # none waited on another

    cluster = Store(str(store))
    manifest = cluster.read_manifest(cluster.uri("curate", "web", plan.fingerprints["curate:web"]))
    assert manifest.execution.mode == "in_slurm_job" and manifest.execution.slurm_job  # the driver
    driver = [j for j in _array_tasks(slurm, "compass-curate-web") if j["JobState"] == "COMPLETED"]
    assert [j["JobId"] for j in driver] == [manifest.execution.slurm_job] and driver[0]["ProcCnt"] == "1"
    assert manifest.metrics["documents_in"] == 1200 and manifest.metrics["documents_out"] < 1200  # dedup removed
    assert curated == _files(tmp_path / "local", "curate")  # bit for bit
    tokens = _files(store, "tokenize")
    assert tokens == _files(tmp_path / "local", "tokenize")
    assert sorted(p for p in tokens if p.startswith("train/")) == [
        f"train/{i:05d}.{ext}" for i in range(SHARDS) for ext in ("offsets.npy", "tokens")]
