"""Shared fixtures: a real Prefect server on 127.0.0.1 for the session, and a CLI runner."""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from compass.flows.compiler import compile_spec
from compass.infra.net import free_port, wait_for_http
from compass.model.training.job import TrainJob

REPO = Path(__file__).resolve().parent.parent
FIXTURES = Path(__file__).resolve().parent / "fixtures"
pytest_plugins = ["tests.scheduling"]
VENV_BIN = Path(sys.executable).parent
if "TRACKIO_DIR" not in os.environ:  # trackio reads it once, when first imported: the session's own database folder
    os.environ["TRACKIO_DIR"] = tempfile.mkdtemp(prefix="compass-trackio-")  # xdist workers inherit it
    atexit.register(shutil.rmtree, os.environ["TRACKIO_DIR"], True)


def migrated_prefect_database() -> Path:
    """An empty Prefect database with every migration applied, made once per Prefect version on this machine: a
    temporary server started on a fresh PREFECT_HOME spends ~7 s of CPU migrating one (measured 14.6 s -> 8.7 s to
    a server that answers), and the suite starts dozens."""
    import fcntl

    import prefect

    folder = Path(tempfile.gettempdir()) / f"compass-tests-prefect-{prefect.__version__}"
    folder.mkdir(exist_ok=True)
    database = folder / "prefect.db"
    with open(folder / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not database.exists():
            home = Path(tempfile.mkdtemp(dir=folder))
            env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
            subprocess.run([str(VENV_BIN / "prefect"), "server", "database", "upgrade", "-y"], check=True,
                           env=env | {"PREFECT_HOME": str(home), "PREFECT_SERVER_ANALYTICS_ENABLED": "false"},
                           capture_output=True, timeout=300)
            (home / "prefect.db").rename(database)  # whole, or not there
            shutil.rmtree(home)
    return database


def base_env(tmp_home: Path) -> dict[str, str]:
    """A compass command's environment: no Prefect settings of ours, its own PREFECT_HOME holding a migrated
    database (its temporary server starts on it)."""
    tmp_home.mkdir(parents=True, exist_ok=True)
    if not (tmp_home / "prefect.db").exists():
        shutil.copyfile(migrated_prefect_database(), tmp_home / "prefect.db")
    rendezvous = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")  # set by in-process training
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_") and k not in rendezvous}
    env.update({"PREFECT_HOME": str(tmp_home), "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
                "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "180", "DO_NOT_TRACK": "1",
                "PATH": f"{VENV_BIN}:{env.get('PATH', '')}"})
    return env


@pytest.fixture(autouse=True)
def autograd_on_after_each_test() -> Iterator[None]:
    """A test that runs lighteval's Pipeline directly leaves autograd off in this worker's thread (lighteval turns it
    off process-wide when it loads a model); the next test in the same worker, a training one, would then compute no
    gradient, depending on which tests share a worker."""
    yield
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.set_grad_enabled(True)


@pytest.fixture(scope="session")
def prefect_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """`compass server` (Prefect's server and UI) on a free loopback port with its own database; stopped at
    the end."""
    home = tmp_path_factory.mktemp("prefect-home")
    port = free_port()
    env = base_env(home)
    log = open(home / "server.log", "w")  # noqa: SIM115 (outlives this block: closed in finally)
    proc = subprocess.Popen([str(VENV_BIN / "compass"), "server", "--port", str(port)],  # 127.0.0.1 by default
                            env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}/api"
    try:
        try:
            wait_for_http(f"{url}/health", proc)
        except RuntimeError as exc:
            raise RuntimeError(f"prefect server did not start ({exc}): "
                               f"{(home / 'server.log').read_text()[-2000:]}") from None
        yield url
    finally:
        drain_prefect_clients()  # before the server goes: what this process still has to send, it sends now
        stop_group(proc)
        log.close()


def drain_prefect_clients() -> None:
    """Send what this process's Prefect log and event workers still hold, and stop them: each is bound to the API
    URL it first wrote to, and one drained at the process's exit, after its server has stopped, prints "Error
    logging to API"."""
    if "prefect" not in sys.modules:
        return
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker

    for worker in (APILogWorker, EventsWorker):
        worker.drain_all(timeout=30)


@pytest.fixture
def prefect_logs(caplog: pytest.LogCaptureFixture) -> pytest.LogCaptureFixture:
    """caplog for a test that reads Prefect's flow- and task-run records: Prefect configures logging when first
    imported (dictConfig replaces the root logger's handlers, caplog's among them), so it is imported here, during
    set-up, before caplog attaches its handler for the test itself. Without this fixture the test would see the
    records only when a test before it in the same worker had imported Prefect."""
    from prefect.logging.configuration import ensure_logging_setup

    ensure_logging_setup()
    return caplog


def stop_group(proc: subprocess.Popen) -> None:
    """Stop a process started with start_new_session: SIGINT (Prefect stops cleanly on it), then SIGKILL."""
    os.killpg(proc.pid, signal.SIGINT)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def _text(output: bytes | str | None) -> str:
    return output.decode(errors="replace") if isinstance(output, bytes) else output or ""


class Cli:
    """Runs `compass ...` in a subprocess, the way a user does."""

    def __init__(self, cwd: Path, env: dict[str, str]):
        self.cwd, self.env = cwd, env

    def __call__(self, *args: str, check: bool = True, timeout: int = 840) -> subprocess.CompletedProcess:
        """`timeout` stays under pytest's own (900 s): a command that hangs fails with what it printed and its
        whole process group (Ray's, datatrove's workers) stopped, not with pytest's stack of this thread."""
        proc = subprocess.Popen([str(VENV_BIN / "compass"), *args], cwd=self.cwd, env=self.env, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            try:
                stdout, stderr = proc.communicate(timeout=30)
            except subprocess.TimeoutExpired as exc:  # a process outside the group still holds the pipes
                stdout, stderr = _text(exc.stdout), _text(exc.stderr)
            raise AssertionError(f"compass {' '.join(args)} still ran after {timeout} s:\n{stdout[-3000:]}\n"
                                 f"{stderr[-8000:]}") from None
        done = subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)
        if check and done.returncode != 0:
            raise AssertionError(f"compass {' '.join(args)} failed ({done.returncode}):\n{done.stdout[-3000:]}\n"
                                 f"{done.stderr[-5000:]}")
        return done

    def json(self, *args: str) -> dict:
        return json.loads(self(*args, "--json").stdout)


@pytest.fixture
def server_cli(prefect_server: str, tmp_path: Path) -> Cli:
    env = base_env(tmp_path / "prefect-client")
    env["PREFECT_API_URL"] = prefect_server
    return Cli(tmp_path, env)


def write_minimal_spec(folder: Path, **replacements: str) -> Path:
    """The minimal spec with absolute fixture paths, optionally edited (old text -> new text)."""
    text = (REPO / "tests" / "specs" / "minimal.yaml").read_text()
    text = text.replace("../fixtures/", f"{FIXTURES}/")
    for old, new in replacements.items():
        assert old in text, old
        text = text.replace(old, new)
    path = folder / "spec.yaml"
    path.write_text(text)
    return path


@pytest.fixture(scope="session")
def stage1_job(data_store: Path, tmp_path_factory: pytest.TempPathFactory):
    """A factory of the minimal spec's pretrain:stage1 jobs, reading their inputs from a copy of `data_store`."""
    import logging

    from compass.infra.store import Store
    from compass.specs import load_spec
    from compass.specs.how import Checkpoints
    from compass.tasks.common.training import build_job
    from compass.tasks.steps.context import InputArtifact, Runtime, StepContext

    folder = tmp_path_factory.mktemp("stage1-job")
    loaded = load_spec(write_minimal_spec(folder))
    plan = compile_spec(loaded.spec)
    store = Store(str(seeded(folder / "store", data_store)))
    step = plan.step("pretrain:stage1")

    def make(workdir: Path, local_cache: Path | None = None, **parallelism) -> TrainJob:
        inputs = {}
        for role, dep in step.inputs.items():
            uri = store.uri(dep.split(":")[0], dep.split(":")[1], plan.fingerprints[dep])
            inputs[role] = InputArtifact(role, dep, uri, store.read_manifest(uri), store)
        how = loaded.spec.how.model_copy(update={
            "parallelism": loaded.spec.how.parallelism.model_copy(update=parallelism),
            "checkpoints": Checkpoints(every_steps=10, keep_last=2),
            "storage": loaded.spec.how.storage.model_copy(update={"local_cache": str(local_cache) if local_cache
                                                                   else None})})
        sctx = StepContext("pretrain", "stage1", step.config, inputs, workdir, workdir, workdir, Runtime(how=how),
                           logging.getLogger("test"), store=store)
        return build_job(sctx, step.config)

    return make


@contextmanager
def prefect_client(api_url: str) -> Iterator:
    """A synchronous Prefect client for the test's server (the test process itself has no PREFECT_API_URL)."""
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings(updates={PREFECT_API_URL: api_url}), get_client(sync_client=True) as client:
        yield client


def settled_task_runs(api_url: str, flow_run_id: Any, names: set[str], timeout: float = 120) -> dict[str, Any]:
    """A flow run's task runs by name, once each of `names` is there in a final state: the server records task
    runs from the events a flow sends, after the flow has returned (later on a busy machine)."""
    import time

    from prefect.client.schemas.filters import FlowRunFilter

    deadline = time.monotonic() + timeout
    while True:
        with prefect_client(api_url) as client:
            runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id={"any_": [flow_run_id]}))
        tasks = {t.name: t for t in runs}
        if all(n in tasks and tasks[n].state is not None and tasks[n].state.is_final() for n in names):
            return tasks
        assert time.monotonic() < deadline, f"task runs {sorted(names)} of flow run {flow_run_id} not settled: " \
            f"{ {n: t.state.type.value if t.state else None for n, t in tasks.items()} }"
        time.sleep(0.5)


def remove_gpu_limit(api_url: str) -> None:
    """The session's server is shared by a worker's test files: `compass deploy` sets the `gpu` tag limit on it,
    and a test that deploys takes it away again, so no later test runs its GPU steps one at a time unawares."""
    from prefect.exceptions import ObjectNotFound

    from compass.flows.server.deployments import GPU_TAG

    with prefect_client(api_url) as client, contextlib.suppress(ObjectNotFound):  # none set: nothing to remove
        client.delete_concurrency_limit_by_tag(GPU_TAG)


def run_up_to(spec_path: Path, target: str | list[str], store: Path) -> tuple[Any, dict[str, Any]]:
    """Every step of the spec's plan up to `target`, in this process (no Prefect); (the plan, outcomes by id)."""
    import logging

    from compass.flows.runner import RunContext, run_step
    from compass.infra.store import Store
    from compass.specs import load_spec
    from compass.tasks.steps.context import Runtime

    loaded = load_spec(spec_path)
    plan = compile_spec(loaded.spec).up_to([target] if isinstance(target, str) else target)
    ctx = RunContext(plan, Store(str(store)), loaded.spec_hash, Runtime(how=loaded.spec.how, base_dir=loaded.base_dir))
    return plan, {s.id: run_step(ctx, s, logging.getLogger("test")) for s in plan.steps}


@pytest.fixture(scope="module")
def slurm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """A real one-node Slurm cluster (tests/slurm_cluster.py) for one test module."""
    with running_cluster(tmp_path_factory.mktemp("slurm")) as env:
        yield env


@pytest.fixture(scope="module")
def gpu_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """An emulated GPU cluster (tests/slurm_cluster.py): two Slurm nodes with two GPUs each, for one test module."""
    with running_cluster(tmp_path_factory.mktemp("gpu-cluster"), nodes=2, gpus_per_node=2) as env:
        yield env


@contextmanager
def running_cluster(folder: Path, nodes: int = 1, gpus_per_node: int = 0, slurmd_timeout: int | None = None,
                    max_array_size: int | None = None, gpu_jobs_only: bool = False) -> Iterator[dict[str, str]]:
    """A Slurm cluster (tests/slurm_cluster.py) started in `folder`; SLURM_CONF points this process and everything
    it starts at it (and, on emulated GPU nodes, COMPASS_REHEARSAL lets their GPU specs' ranks compute on the CPU),
    restored afterwards."""
    from tests.slurm_cluster import missing, slurm_cluster

    why = missing()
    if why:
        raise RuntimeError(f"{why} (run `bash infra/setup.sh` as root)")
    from compass.model.training.rank_device import REHEARSAL_ENV

    with slurm_cluster(folder, nodes, gpus_per_node, slurmd_timeout, max_array_size, gpu_jobs_only) as env:
        if gpus_per_node:  # emulated GPUs: every job on these nodes is a rehearsal, its GPU spec's ranks on the CPU
            env = {**env, REHEARSAL_ENV: "1"}
        saved = {key: os.environ.get(key) for key in env}
        os.environ.update(env)
        try:
            yield env
        finally:
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value


def built_once(tmp_path_factory: pytest.TempPathFactory, name: str, build: Callable[[Path], None]) -> Path:
    """A folder built once per test session and shared by every xdist worker: the first worker to ask builds it
    (under a lock in the session's common temporary folder), the others wait for it. Tests never write into it:
    they copy it (`seeded`)."""
    import fcntl

    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # the workers' base folders are siblings under the session's own
    folder, done = root / f"prepared-{name}", root / f"prepared-{name}.done"
    with open(root / f"prepared-{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, also when a worker dies
        if not done.exists():
            shutil.rmtree(folder, ignore_errors=True)  # what a worker that died mid-build left
            folder.mkdir()
            build(folder)
            done.touch()
    return folder


def seeded(store: Path, prepared: Path) -> Path:
    """`store` holding a copy of a prepared store's artifacts: a test's steps whose fingerprints match them are
    found committed, every other step runs."""
    store.mkdir(parents=True, exist_ok=True)
    for kind in (prepared / "store").iterdir():  # artifacts only: no work folders, locks or monitoring of the build
        if kind.is_dir() and not kind.name.startswith(".") and kind.name != "monitoring":
            shutil.copytree(kind, store / kind.name, dirs_exist_ok=True)
    return store


def seeded_s3(fs: Any, root: str, prepared: Path) -> str:
    """`seeded` for a store on S3: the prepared store's artifacts uploaded under `root` (s3://bucket/prefix) through
    `fs` (an s3fs filesystem), each artifact's manifest last."""
    base = prepared / "store"
    for kind in sorted(p for p in base.iterdir() if p.is_dir() and not p.name.startswith(".") and
                       p.name != "monitoring"):
        for artifact in sorted(kind.iterdir()):
            files = sorted(p for p in artifact.rglob("*") if p.is_file())
            for path in sorted(files, key=lambda p: p.name == "manifest.json"):
                fs.put_file(str(path), f"{root.removeprefix('s3://')}/{path.relative_to(base).as_posix()}")
    fs.invalidate_cache()
    return root


def _prepare(folder: Path, until: list[str] | set[str], seed: Path | None = None, **replacements: str) -> None:
    """The minimal spec (absolute fixture paths, as every test's spec has them) run in this process into
    `folder`/store, up to `until` (step ids or kinds)."""
    from compass.flows.runner import run_in_process
    from compass.infra.store import Store
    from compass.specs import load_spec
    from compass.tasks.steps.context import Runtime

    loaded = load_spec(write_minimal_spec(folder, **replacements))
    store = seeded(folder / "store", seed) if seed else folder / "store"
    run_in_process(compile_spec(loaded.spec).up_to(list(until)), Store(str(store)), loaded.spec_hash,
                   Runtime(how=loaded.spec.how, base_dir=loaded.base_dir))


DATA_KINDS = ["ingest", "curate", "tokenizer", "tokenize"]


@pytest.fixture(scope="session")
def data_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The minimal spec's data steps (ingest, curation, tokenizer, tokens), run once per session: `seeded(store,
    data_store)` gives a test a store where they are committed."""
    return built_once(tmp_path_factory, "data", lambda folder: _prepare(folder, DATA_KINDS))


@pytest.fixture(scope="session")
def trained_store(data_store: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`data_store` and the minimal spec's two pretraining stages, trained once per session."""
    return built_once(tmp_path_factory, "trained",
                      lambda folder: _prepare(folder, ["pretrain:stage2"], seed=data_store))


TRL_CHECKPOINTS = "how:\n  checkpoints: {every_steps: 2, keep_last: 2}\n"  # the TRL tests' cadence (resumes)


@pytest.fixture(scope="session")
def trl_trained_store(data_store: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`trained_store` trained under the TRL tests' checkpoint cadence: how.checkpoints is part of a training
    step's identity (which checkpoints its artifact keeps), so their specs' pretraining is this one."""
    return built_once(tmp_path_factory, "trained-trl",
                      lambda folder: _prepare(folder, ["pretrain:stage2"], seed=data_store,
                                              **{"how:\n": TRL_CHECKPOINTS}))


CHECKPOINTED_STAGE = {  # the minimal spec's first stage, long enough to be caught mid-run, a checkpoint every 10 steps
    "tokens: 20000, sequence_length: 64": "tokens: 40000, sequence_length: 64",
    "  parallelism: {micro_batch_size: 2}": "  checkpoints: {every_steps: 10}\n  parallelism: {micro_batch_size: 2}"}


def cluster_spec(folder: Path, shared: Path, **replacements: str) -> Path:
    """The minimal spec with its steps run as jobs of this machine's Slurm cluster, shared root `shared`."""
    cluster = f"\n  orchestration: {{cluster: {{kind: slurm, poll_seconds: 0.5, shared_root: {shared}}}}}\n"
    path = write_minimal_spec(folder, **replacements)
    path.write_text(path.read_text().rstrip() + cluster)
    return path


def final_weights_sha(store: Path, step_id: str) -> str:
    """The sha256 of a committed model step's final weights, from its manifest."""
    from compass.infra.layout import WEIGHTS, ModelArtifact

    kind, name = step_id.split(":")
    (path,) = store.glob(f"{kind}/{name}-*/manifest.json")
    final = ModelArtifact(path.parent).final.relative_to(path.parent).as_posix()
    return next(f["sha256"] for f in json.loads(path.read_text())["files"] if f["path"] == f"{final}/{WEIGHTS}")


@pytest.fixture(scope="session")
def stage1_reference(data_store: Path, tmp_path_factory: pytest.TempPathFactory) -> str:
    """The final weights' sha256 of the checkpointed first stage trained undisturbed, in this process."""
    folder = built_once(tmp_path_factory, "stage1-reference",
                        lambda folder: _prepare(folder, ["pretrain:stage1"], seed=data_store, **CHECKPOINTED_STAGE))
    return final_weights_sha(folder / "store", "pretrain:stage1")
