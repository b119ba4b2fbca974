"""Where every step runs, on a real one-node Slurm cluster (tests/slurm_cluster.py):

- a spec with a cluster runs its gate, data, ablation, pretraining, mid-training, post-training and evaluation steps
  each as the Slurm job its phase's shape says, and the orchestrating `compass run` imports no model library;
- inside a job the ranks get the CPUs the spec asked for (one each: their affinity is read in the ranks);
- `kill -9` of `compass run` mid-stage, then `compass run` again: the same job is followed (the controller's job
  history holds one job for the stage), the stage commits, and its weights equal an undisturbed run's;
- a shared root that the compute nodes do not see is refused before any step's job is submitted, naming the path
  and the field to set (the orchestrator runs in a mount namespace of its own, where the root is a private tmpfs).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from compass.infra import slurm as slurm_jobs
from compass.infra.layout import WorkFolder
from compass.infra.store import Store
from tests.conftest import (
    CHECKPOINTED_STAGE,
    FIXTURES,
    REPO,
    VENV_BIN,
    base_env,
    cluster_spec,
    final_weights_sha,
    seeded,
)
from tests.hub_cache import seed_model, tiny_llama
from tests.slurm_cluster import finished_jobs

pytestmark = pytest.mark.slow
HEAVY = {"torch", "transformers", "trl", "lighteval", "deepspeed", "peft", "datasets", "accelerate"}


def history(env: dict[str, str]) -> list[dict[str, str]]:
    """Every job the controller finished (its completion log: jobcomp/filetxt)."""
    return finished_jobs(env["SLURM_CONF"])


def wait_for(check, what: str, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


EVERY_PHASE = """name: everywhere
why:
  reason: production
  need: a small assistant, trained where the cluster says
  existing_models:
    - {model: acme/tiny-chat}
  success_criteria:
    - {metric: "arc_easy:cf/acc", op: ">=", threshold: 1.01}
what:
  architecture: {num_layers: 2, hidden_size: 64, ffn_size: 128, num_heads: 4, num_kv_heads: 2,
                 positions: {kind: rope, rope_theta: 10000}}
  tokenizer:
    candidates:
      - {kind: bpe, vocab_size: 300}
      - {kind: bpe, vocab_size: 400}
    train_chars: 100000
    eval_chars: 20000
  data:
    sources:
      - name: notes
        uri: FIXTURES/corpus/en
        include: ["*.txt"]
        format: text
        language: en
        domain: web
        curation:
          filters:
            - {name: gopher_repetition}
            - {name: gopher_quality, params: {min_doc_words: 20}}
          language_id: {keep: [en], min_score: 0.3}
          minhash: {n_grams: 5, num_buckets: 8, hashes_per_bucket: 8}
          heldout_fraction: 0.2
      - name: code
        uri: FIXTURES/corpus/code
        include: ["*.py"]
        format: code
        domain: code
        curation: {heldout_fraction: 0.2}
  ablations:
    baseline: {tokens: 2048, sequence_length: 64, global_batch_size: 4, mixture: {notes: 0.7, code: 0.3}}
    variants:
      - {name: untied, change: {architecture.tied_embeddings: false}}
    seeds: [0]
  pretraining:
    schedule: {kind: wsd, warmup_steps: 1}
    stages:
      - {name: stage1, tokens: 8192, sequence_length: 512, global_batch_size: 4, mixture: {notes: 0.7, code: 0.3},
         schedule_segment: decay}
  post_training:
    - {method: mid_training, name: mid, dataset: code, tokens: 4096, lr: 1.0e-3, batch_size: 4}
    - {method: sft, name: sft, dataset: "pypi://evals==3.0.1.post1", lr: 1.0e-3, max_samples: 8, max_length: 128,
       batch_size: 4}
  evaluation:
    benchmarks: [{name: arc_easy, formulation: cf, limit: 4}]
    perplexity_sources: [notes]
how:
  hardware: {devices_per_node: 2}
  parallelism: {micro_batch_size: 1, data_parallel: 2, deepspeed: false}
  resources:
    data: {cpus_per_node: 1}  # one task per array (array tasks of many: tests/test_data_scale_slurm.py)
    pretraining: {cpus_per_node: 2}
    ablation: {devices_per_node: 1}
    mid_training: {devices_per_node: 1}
  evaluation: {every_checkpoint: false}
  orchestration: {max_parallel_steps: 2, cluster: {kind: slurm, poll_seconds: 0.5, shared_root: SHARED}}
"""
PHASE_OF = {"gate": "evaluation", "ingest": "data", "curate": "data", "tokenizer": "data", "tokenize": "data",
            "fence_index": "data", "decontaminate": "data",
            "ablate": "ablation", "pretrain": "pretraining", "mid_training": "mid_training",
            "post_train": "post_training", "evaluate": "evaluation"}
SHAPES = {"data": (1, 0), "ablation": (1, 1), "pretraining": (1, 2), "mid_training": (1, 1), "post_training": (1, 1),
          "evaluation": (1, 1)}


def test_every_phase_runs_as_the_job_its_shape_says_and_the_orchestrator_loads_no_model(slurm, prefect_server: str,
                                                                                      data_store: Path, tmp_path: Path):
    """The data section is the minimal spec's: its steps are the session's, committed, but for one, which runs
    as the data phase's job (data steps as Slurm arrays: tests/test_data_scale_slurm.py)."""
    (data_job,) = seeded(tmp_path / "store", data_store).glob("tokenize/code-*")
    shutil.rmtree(data_job)
    hub = tmp_path / "hub"
    seed_model(hub / "cache", "acme/tiny-chat", tiny_llama(hub / "files"))
    spec = tmp_path / "spec.yaml"
    spec.write_text(EVERY_PHASE.replace("FIXTURES", str(FIXTURES)).replace("SHARED", str(tmp_path / "shared")))
    env = base_env(tmp_path / "prefect") | {"HF_HUB_CACHE": str(hub / "cache"), "PREFECT_API_URL": prefect_server}
    record = tmp_path / "orchestrator.json"
    done = subprocess.run([sys.executable, "-m", "tests.watched_cli", str(record), "run", str(spec), "--store",
                           str(tmp_path / "store"), "--json"], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=1800)
    assert done.returncode == 0, done.stderr[-4000:]
    steps = {s["step"]: s for s in json.loads(done.stdout)["steps"]}
    assert {k.split(":")[0] for k in steps} >= set(PHASE_OF) | {"compare", "curves", "report"}
    cached = {k for k, s in steps.items() if not s["executed"]}
    assert cached == {"ingest:notes", "ingest:code", "curate:notes", "curate:code", "tokenizer:select",
                      "tokenize:notes"}
    fence = {"fence_index:benchmarks", "decontaminate:benchmarks"}  # the decontamination fence: data jobs too
    assert cached | {"tokenize:code"} | fence == {k for k in steps if PHASE_OF.get(k.split(":")[0]) == "data"}
    steps = {k: s for k, s in steps.items() if s["executed"]}  # each a job of its phase's shape (below)

    jobs = {j["JobId"]: j for j in history(slurm)}
    store = Store(str(tmp_path / "store"))
    for step_id, step in steps.items():
        manifest = store.read_manifest(step["uri"])
        kind = step_id.split(":")[0]
        if kind not in PHASE_OF:  # bookkeeping: it read other steps' manifests in the orchestrator
            assert manifest.execution.mode == "in_process", step_id
            continue
        execution = manifest.execution
        assert execution.mode == "in_slurm_job" and execution.slurm_job in jobs, step_id
        job = jobs[execution.slurm_job]
        nodes, devices = SHAPES[PHASE_OF[kind]]
        assert (execution.nodes, execution.devices_per_node) == (nodes, devices), step_id
        assert job["JobState"] == "COMPLETED" and job["NodeCnt"] == str(nodes), (step_id, job)
        assert job["Name"] == f"compass-{kind}-{step_id.split(':')[1]}"[:48], (step_id, job)
    assert len({store.read_manifest(s["uri"]).execution.slurm_job for s in steps.values()} - {None}) == \
        sum(k.split(":")[0] in PHASE_OF for k in steps)  # one job per computing step

    pretrain = store.read_manifest(steps["pretrain:stage1"]["uri"]).metrics
    cpus = [r["cpus"] for r in pretrain["ranks"]]
    assert len(cpus) == 2 and all(len(c) == 1 for c in cpus) and cpus[0] != cpus[1]  # one CPU each, not shared
    assert "2 ranks (2 data-parallel" in pretrain["parallel"]
    gate = store.read_manifest(steps["gate:acme-tiny-chat"]["uri"]).metrics
    assert gate["verdict"] == "justified"

    loaded = json.loads(record.read_text())
    assert not HEAVY & set(loaded["heavy_modules"]), loaded  # it planned, submitted, followed and committed


# keep_last 1, a checkpoint every 10 steps and the held-out perplexity evaluated at every checkpoint
EVALUATED_STAGE = {**CHECKPOINTED_STAGE,
                   "  parallelism: {micro_batch_size: 2}": "  checkpoints: {every_steps: 10, keep_last: 1}\n"
                                                           "  parallelism: {micro_batch_size: 2}",
                   "  pretraining:": "  evaluation: {perplexity_sources: [notes]}\n  pretraining:"}


@pytest.mark.timeout(1500)
def test_killed_orchestrators_are_followed_not_resubmitted_and_every_checkpoint_is_evaluated(
        slurm, data_store: Path, prefect_server: str, stage1_reference: str, tmp_path: Path):
    """`kill -9` of `compass run` mid-stage, twice: each next run follows the stage's live job (never a second one);
    the stage's weights equal an undisturbed run's; and with keep_last 1, every checkpoint the stage wrote is
    evaluated exactly once by the evaluate step's job (keep_last pruned their training state, not their exports)."""
    spec = cluster_spec(tmp_path, tmp_path / "shared", **EVALUATED_STAGE)
    store = tmp_path / "store"
    seeded(store, data_store)
    env = base_env(tmp_path / "prefect") | {"PREFECT_API_URL": prefect_server}
    argv = [str(VENV_BIN / "compass"), "run", str(spec), "--store", str(store), "--until",
            "evaluate:pretrain-stage1"]
    before = {j["JobId"] for j in history(slurm)}
    start = lambda: subprocess.Popen(argv, cwd=tmp_path, env=env, stdout=subprocess.DEVNULL,  # noqa: E731
                                     stderr=subprocess.DEVNULL, start_new_session=True)
    first = start()
    records = lambda: list((store / ".work").glob(f"pretrain/stage1-*/{WorkFolder(Path()).job_record.name}"))  # noqa: E731

    def submitted() -> bool:
        assert first.poll() is None, "the first orchestrator ended before it submitted the stage's job"
        return bool(records())

    wait_for(submitted, "the stage's job to be submitted")
    work = WorkFolder(records()[0].parent)
    job = slurm_jobs.read_record(work.root).job_id
    newest = lambda: max((c.step for c in work.everything_to_evaluate()), default=0)  # noqa: E731
    wait_for(lambda: newest() >= 10, "the stage's first checkpoint")
    subprocess.run(["scontrol", "suspend", job], check=True)  # mid-stage, until the next orchestrator follows it
    os.killpg(first.pid, signal.SIGKILL)  # the orchestrator, nothing else
    first.wait()
    assert slurm_jobs.state_of(job).live  # the job stays, unwatched

    # the second orchestrator follows the job, which trains on past two more checkpoints; then it is killed too
    at_first_kill = newest()
    resumer = resume_once_followed(job, store)
    second = start()
    wait_for(lambda: newest() >= at_first_kill + 20, "two more checkpoints under the second orchestrator")
    resumer.join(timeout=10)
    subprocess.run(["scontrol", "suspend", job], check=True)
    os.killpg(second.pid, signal.SIGKILL)
    second.wait()
    assert slurm_jobs.state_of(job).live

    resumer = resume_once_followed(job, store)
    third = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    resumer.join(timeout=10)
    assert third.returncode == 0, third.stderr[-4000:]
    said = " ".join(third.stderr.split())  # the terminal wraps long lines
    assert f"following Slurm job {job}" in said
    assert not re.search(r"submitted Slurm job \d+ \(\S*pretrain/stage1", said)
    named = [j for j in history(slurm) if j["Name"] == "compass-pretrain-stage1" and int(j["JobId"]) >= int(job)]
    assert [j["JobId"] for j in named] == [job] and named[0]["JobState"] == "COMPLETED"
    assert final_weights_sha(store, "pretrain:stage1") == stage1_reference  # as if nobody had been killed
    assert not work.root.exists()  # committed: its work folder is gone
    # one probe job in all, before the stage's: the first run's flow and the later runs reuse its recorded pass, so
    # a run that follows a live job (on a partition that job may fill) needs no free node
    probes = [j["JobId"] for j in history(slurm) if j["Name"] == "compass-probe" and j["JobId"] not in before]
    assert len(probes) == 1 and int(probes[0]) < int(job), probes

    # every checkpoint (every 10 steps and the stage's last) scored once, in order, though keep_last was 1
    stage = json.loads(next(store.glob("pretrain/stage1-*/manifest.json")).read_text())["metrics"]
    steps = stage["steps"]
    every = [f"step-{s:08d}" for s in [*range(10, steps, 10), steps]]
    assert stage["checkpoints"] == [every[-1]] and stage["exports"] == every
    evaluation = json.loads(next(store.glob("evaluate/pretrain-stage1-*/manifest.json")).read_text())["metrics"]
    assert [point["checkpoint"] for point in evaluation["curve"]] == every
    assert all(point["val_ppl:notes"] > 1 for point in evaluation["curve"])
    tokens = [point["tokens"] for point in evaluation["curve"]]
    assert tokens == sorted(tokens) and len(set(tokens)) == len(tokens)


def test_scheduled_evaluations_of_a_cluster_spec_run_as_evaluation_jobs(slurm, trained_store: Path,
                                                                        prefect_server: str, tmp_path: Path):
    """`compass evaluate-schedule` (what a deployment's schedule and each checkpoint event run) of a spec with a
    cluster: each checkpoint is scored by a Slurm job of the evaluation phase's shape, as the run's evaluate step,
    not in the worker's process; each result names its job."""
    store = seeded(tmp_path / "store", trained_store)  # two stages committed: two checkpoints
    suite = ("  evaluation:\n    benchmarks:\n      - {name: arc_easy, formulation: cf, limit: 4}\n"
             "    perplexity_sources: [notes]\n  pretraining:")  # the criterion of minimal.yaml is val_ppl:notes
    spec = cluster_spec(tmp_path, tmp_path / "shared", **{"  pretraining:": suite})
    before = {j["JobId"] for j in history(slurm)}
    env = base_env(tmp_path / "prefect") | {"PREFECT_API_URL": prefect_server}
    done = subprocess.run([str(VENV_BIN / "compass"), "evaluate-schedule", str(spec), "--root", str(store), "--once",
                           "--json"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    scan = json.loads(done.stdout)
    assert scan["checkpoints"] == 2 and len(scan["evaluated"]) == 2
    jobs = {j["JobId"]: j for j in history(slurm) if j["JobId"] not in before}
    evaluations = {i: j for i, j in jobs.items() if j["Name"].startswith("compass-evaluate-")}
    assert len(evaluations) == 2 and all(j["JobState"] == "COMPLETED" for j in evaluations.values()), jobs
    records = [json.loads(p.read_text()) for p in store.glob(".evaluations/*/*.json")]
    assert sorted(r["slurm_job"] for r in records) == sorted(evaluations)  # computed by those jobs, not here
    assert all(0 <= r["metrics"]["arc_easy:cf/acc"] <= 1 for r in records)
    assert not list((tmp_path / "shared").rglob("checkpoint-evaluation.json"))  # their work folders cleared


def resume_once_followed(job: str, store: Path) -> threading.Thread:
    """Resume the suspended job as soon as a live orchestrator's lock on the stage names it (the one it follows)."""
    import psutil

    def followed() -> bool:
        for lock in (store / ".locks").rglob("*.lock"):
            with contextlib.suppress(OSError, ValueError):
                holder = json.loads(lock.read_text())
                if holder.get("job") == job and psutil.pid_exists(holder["pid"]):
                    return True
        return False

    def resume() -> None:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            if followed():
                subprocess.run(["scontrol", "resume", job], check=True)
                return
            time.sleep(0.5)

    thread = threading.Thread(target=resume, daemon=True)
    thread.start()
    return thread


def run_with_a_private_mount(folder: Path, spec: Path, cwd: Path, env: dict[str, str],
                             filled_from: Path | None = None) -> subprocess.CompletedProcess:
    """`compass run SPEC` with `folder` a tmpfs only its process sees (a mount namespace of its own), filled with a
    copy of `filled_from` there: a folder the orchestrating machine has and the compute nodes do not."""
    if shutil.which("unshare") is None:
        raise RuntimeError("unshare (util-linux) is needed to give the orchestrator a mount of its own")
    folder.mkdir(parents=True, exist_ok=True)
    fill = f" && cp -r {filled_from}/. {folder}" if filled_from else ""
    compass = f"{VENV_BIN / 'compass'} run {spec} --store {cwd}/store"
    mount = f"mount -t tmpfs compass-private {folder}{fill} && exec {compass}"
    return subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", mount], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=600)


def test_a_shared_root_the_nodes_do_not_see_is_refused_before_anything_is_submitted(slurm, tmp_path: Path):
    shared = tmp_path / "private-shared"
    spec = cluster_spec(tmp_path, shared)
    before = {j["JobId"] for j in history(slurm)}
    done = run_with_a_private_mount(shared, spec, tmp_path, base_env(tmp_path / "prefect"))
    assert done.returncode == 2, done.stderr[-3000:]
    said = " ".join(done.stderr.split())  # the terminal wraps long lines
    assert f"how.orchestration.cluster.shared_root: {shared} is not shared" in said
    assert "mounts at the same path" in said and f"{spec}:" in said
    new = [j for j in history(slurm) if j["JobId"] not in before]
    assert [j["Name"] for j in new] == ["compass-probe"]  # the probe, and no step's job
    assert not (tmp_path / "store").exists()


def test_a_hub_cache_the_nodes_do_not_see_is_refused_before_anything_is_submitted(slurm, tmp_path: Path):
    """N11: a hub tokenizer candidate read from a Hugging Face cache only the orchestrating machine mounts (a tmpfs
    of its own mount namespace, filled there): the probe job finds its snapshot missing on the compute node and the
    run stops with the spec field, the path and how to share the cache; nothing is submitted after the probe."""
    from tests.test_hub_tokenizer import CANDIDATES, HUB_CANDIDATE, REPO_ID, published_tokenizer

    filled = tmp_path / "filled-cache"
    seed_model(filled, REPO_ID, published_tokenizer(tmp_path / "tokenizer"))
    private = tmp_path / "private-cache"
    spec = cluster_spec(tmp_path, tmp_path / "shared", **{CANDIDATES: HUB_CANDIDATE})
    before = {j["JobId"] for j in history(slurm)}
    env = base_env(tmp_path / "prefect") | {"HF_HUB_CACHE": str(private)}
    done = run_with_a_private_mount(private, spec, tmp_path, env, filled_from=filled)
    assert done.returncode == 2, done.stderr[-3000:]
    said = " ".join(done.stderr.split())  # the terminal wraps long lines
    assert f"what.tokenizer.candidates[0].repo: the tokenizer {REPO_ID} in the Hugging Face cache ({private}/" in said
    assert "is not visible on compute node" in said and "set HF_HUB_CACHE to a folder under" in said
    new = [j for j in history(slurm) if j["JobId"] not in before]
    assert [j["Name"] for j in new] == ["compass-probe"]  # the probe, and no step's job
    assert not (tmp_path / "store").exists()
