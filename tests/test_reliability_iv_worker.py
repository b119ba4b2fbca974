"""Issue 80, item 2: a run a deployment started writes only under the worker's store and COMPASS_ALLOWED_ROOTS.
Every other folder a submitted spec names for writing (node-local staging, the monitoring folder, an MLflow
database or file store, a cluster's shared root) is refused on the worker before any step, each field named at its
line; the same folders under the worker's roots run. The flow runs on the test's Prefect server as a worker's flow
run (Prefect's PREFECT__RUNTIME__DEPLOYMENT__ID set, the worker's store and spec folder configured)."""

from __future__ import annotations

import shutil
import uuid
from pathlib import Path

import pytest

from compass.flows.server.confinement import writes_outside_worker
from compass.specs.loader import SpecError, load_spec
from tests.conftest import FIXTURES, write_minimal_spec

HOW = "  parallelism: {micro_batch_size: 2}"


@pytest.fixture
def worker(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, Path]:
    """This process as a worker's flow run: (its store, its spec folder); no other allowed roots."""
    store, specs = tmp_path / "worker-store", tmp_path / "worker-specs"
    specs.mkdir()
    monkeypatch.setenv("PREFECT__RUNTIME__DEPLOYMENT__ID", str(uuid.uuid4()))
    monkeypatch.setenv("COMPASS_WORKER_STORE", str(store))
    monkeypatch.setenv("COMPASS_WORKER_SPECS", str(specs))
    monkeypatch.delenv("COMPASS_ALLOWED_ROOTS", raising=False)
    monkeypatch.chdir(tmp_path)
    return store, specs


def _submitted(specs: Path, cache: Path, monitoring: Path) -> Path:
    """The minimal spec, its data in the worker's spec folder, naming a staging and a monitoring folder."""
    shutil.copytree(FIXTURES / "corpus", specs / "corpus", dirs_exist_ok=True)
    return write_minimal_spec(specs, **{f"{FIXTURES}/corpus": str(specs / "corpus"),
                                        HOW: f"{HOW}\n  storage: {{local_cache: {cache}}}\n"
                                             f"  monitoring: {{folder: {monitoring}}}"})


def _run(prefect_server: str, spec: Path, specs: Path, store: Path) -> dict:
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from compass.flows.lifecycle import lifecycle

    with temporary_settings({PREFECT_API_URL: prefect_server}):
        return lifecycle(spec_yaml=spec.read_text(), spec_path=str(spec), base_dir=str(specs),
                         store_root=str(store), until=["ingest:notes"])


def test_a_submitted_spec_naming_write_folders_outside_the_worker_is_refused_before_any_step(
        prefect_server: str, worker: tuple[Path, Path], tmp_path: Path, prefect_logs: pytest.LogCaptureFixture):
    store, specs = worker
    cache, monitoring = tmp_path / "elsewhere" / "cache", tmp_path / "elsewhere" / "monitoring"
    spec = _submitted(specs, cache, monitoring)
    lines = spec.read_text().splitlines()
    with pytest.raises(SpecError) as refused:
        _run(prefect_server, spec, specs, store)
    said = str(refused.value)
    for field, folder in (("how.storage.local_cache", cache), ("how.monitoring.folder", monitoring)):
        line = next(i for i, text in enumerate(lines, 1) if str(folder) in text)
        assert f"{spec}:{line}: {field}: {folder} resolves to {folder}, outside the folders this worker writes" in said
    assert "COMPASS_ALLOWED_ROOTS" in said and "Traceback" not in prefect_logs.text
    assert not (tmp_path / "elsewhere").exists() and not list(store.glob("ingest/*"))  # before any step


@pytest.mark.slow  # ingests the minimal spec's source
def test_the_same_folders_under_the_workers_roots_run(prefect_server: str, worker: tuple[Path, Path],
                                                      tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """Under the worker's store, or a folder of COMPASS_ALLOWED_ROOTS (the node-local disk a team's worker names):
    the run goes on."""
    store, specs = worker
    monkeypatch.setenv("COMPASS_ALLOWED_ROOTS", str(tmp_path / "scratch"))
    spec = _submitted(specs, tmp_path / "scratch" / "cache", store / "monitoring" / "mine")
    summary = _run(prefect_server, spec, specs, store)
    assert [s["step"] for s in summary["steps"] if s["executed"]] == ["ingest:notes"]


@pytest.mark.parametrize("field", ["mlflow", "shared_root", "link", "relative"])
def test_every_write_field_is_judged_where_the_write_reaches(worker: tuple[Path, Path], tmp_path: Path, field: str):
    """An MLflow database, a cluster's shared root, a link inside the worker's store that leads out of it, and a
    relative folder (from the spec's folder, as the write resolves it)."""
    store, specs = worker
    outside = tmp_path / "outside"
    outside.mkdir()
    how, named = {
        "mlflow": (f"  monitoring: {{trackers: [mlflow], mlflow_tracking_uri: 'sqlite:///{outside}/mlflow.db'}}",
                   "how.monitoring.mlflow_tracking_uri"),
        "shared_root": (f"  orchestration: {{cluster: {{shared_root: {outside}}}}}",
                        "how.orchestration.cluster.shared_root"),
        "link": (f"  monitoring: {{folder: {store}/link/m}}", "how.monitoring.folder"),
        "relative": ("  storage: {local_cache: ../outside/cache}", "how.storage.local_cache"),
    }[field]
    store.mkdir()
    (store / "link").symlink_to(outside)
    loaded = load_spec(write_minimal_spec(specs, **{HOW: f"{HOW}\n{how}"}))
    refused = list(writes_outside_worker(loaded.spec, specs))
    assert [".".join(map(str, issue.loc)) for issue in refused] == [named]
    assert str(outside) in refused[0].message
    (store / "link").unlink()
    (store / "link").mkdir()
    if field == "link":  # the same field, now a folder of the store's own: admitted
        assert not list(writes_outside_worker(loaded.spec, specs))
