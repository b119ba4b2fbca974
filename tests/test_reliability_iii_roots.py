"""One rule for every place compass writes (issue 46, R22, R26-R32): the file system's root and the system folders
are refused for a store given with `--store` (R27, R28), a submitted `store_root` (R30: a worker also writes only
into its own store), the monitoring folder (R26), an MLflow database (R22) and a cluster's shared root, which must
also be absolute (R32); a `--store` inside a local source is refused (R31). Each refusal is one located sentence,
exit 2, with nothing written and no traceback."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tests.conftest import write_minimal_spec

MINIMAL_HOW = "how:\n"


def refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, *args: str) -> str:
    from compass.flows.cli.app import app

    work = tmp_path / "work"
    work.mkdir(exist_ok=True)
    monkeypatch.chdir(work)
    done = CliRunner().invoke(app, list(args))
    assert done.exit_code == 2, done.output
    assert "Traceback" not in done.output
    assert not list(work.iterdir())  # nothing written
    return " ".join(done.output.split())


@pytest.mark.parametrize(("store", "what"), [("/", "the file system root"), ("/etc", "a system folder"),
                                             ("/usr/local/compass-store", "a system folder")])
def test_R27_R28_a_store_option_on_a_system_folder_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                              store: str, what: str):
    spec = write_minimal_spec(tmp_path)
    for command in ("plan", "run"):
        out = refused(tmp_path, monkeypatch, command, str(spec), "--store", store)
        assert f"--store {store}: {store} is {what}: a store writes and deletes folders under it" in out


@pytest.mark.parametrize(("how", "field", "what"), [
    ("  monitoring: {folder: /etc/compass-monitoring}", "how.monitoring.folder", "a system folder: monitoring"),
    ("  monitoring: {trackers: [mlflow], mlflow_tracking_uri: 'sqlite:////etc/mlflow.db'}",
     "how.monitoring.mlflow_tracking_uri", "a system folder: MLflow"),
    ("  monitoring: {trackers: [mlflow], mlflow_tracking_uri: 'file:///usr/mlruns'}",
     "how.monitoring.mlflow_tracking_uri", "a system folder: MLflow"),
    ("  orchestration: {cluster: {kind: slurm, shared_root: /}}", "how.orchestration.cluster.shared_root",
     "the file system root: a cluster's run"),
    ("  orchestration: {cluster: {kind: slurm, shared_root: /etc}}", "how.orchestration.cluster.shared_root",
     "a system folder: a cluster's run"),
    ("  orchestration: {cluster: {kind: slurm, shared_root: shared/compass}}",
     "how.orchestration.cluster.shared_root", "is relative: every node must find it at the same path"),
])
def test_R26_R22_R32_write_roots_in_the_spec_are_refused_at_their_line(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch, how: str,
                                                                       field: str, what: str):
    spec = write_minimal_spec(tmp_path, **{MINIMAL_HOW: f"how:\n{how}\n"})
    line = spec.read_text().splitlines().index(how) + 1
    out = refused(tmp_path, monkeypatch, "validate", str(spec))
    assert f"{spec}:{line}: {field}:" in out and what in out


def test_R31_a_store_option_inside_a_local_source_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    source = tmp_path / "corpus"
    source.mkdir()
    (source / "a.txt").write_text("A document of the local source, long enough to be one.")
    spec = write_minimal_spec(tmp_path)
    spec.write_text(spec.read_text().replace(spec.read_text().split("uri: ")[1].split("\n")[0], str(source), 1))
    out = refused(tmp_path, monkeypatch, "plan", str(spec), "--store", str(source / "store"))
    assert f"the store {source / 'store'} lies inside the local source 'notes' ({source})" in out


@pytest.mark.slow
def test_R30_a_submitted_store_root_outside_the_workers_store_fails_before_any_step(
        prefect_server: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, prefect_logs: pytest.LogCaptureFixture):
    """As a worker's flow run (Prefect's deployment id set, the worker's store and spec folder configured). Each
    refusal is one line in the flow run's log, without a traceback (issue 45 item 8): the store root's, and the
    spec's reading outside the worker's roots."""
    import shutil

    from prefect.settings import PREFECT_API_URL, temporary_settings

    from compass.flows.lifecycle import lifecycle
    from compass.specs.loader import SpecError
    from tests.conftest import FIXTURES

    store, specs = tmp_path / "worker-store", tmp_path / "worker-specs"
    specs.mkdir()
    monkeypatch.setenv("PREFECT__RUNTIME__DEPLOYMENT__ID", str(uuid.uuid4()))
    monkeypatch.setenv("COMPASS_WORKER_STORE", str(store))
    monkeypatch.setenv("COMPASS_WORKER_SPECS", str(specs))
    monkeypatch.setenv("COMPASS_ALLOWED_ROOTS", str(Path(__file__).parent / "fixtures"))  # the spec's sources
    monkeypatch.chdir(tmp_path)
    spec = write_minimal_spec(specs)
    elsewhere = tmp_path / "elsewhere"
    for root, expected in ((str(elsewhere), f"store_root {elsewhere}: {elsewhere} is outside the stores this worker "
                                            f"writes ({store}"),
                           ("/usr/compass-store", "store_root /usr/compass-store: /usr/compass-store is a system "
                                                  "folder")):
        prefect_logs.clear()
        with temporary_settings({PREFECT_API_URL: prefect_server}), pytest.raises(ValueError) as refusal:
            lifecycle(spec_yaml=spec.read_text(), spec_path=str(spec), base_dir=str(specs), store_root=root,
                      until=["ingest:notes"])
        assert expected in str(refusal.value)
        assert expected in prefect_logs.text and "Traceback" not in prefect_logs.text
    assert not elsewhere.exists() and not Path("/usr/compass-store").exists()

    outside = tmp_path / "outside"  # the worker's files a submitter wants read
    shutil.copytree(FIXTURES / "corpus", outside)
    monkeypatch.delenv("COMPASS_ALLOWED_ROOTS")
    reading = write_minimal_spec(specs, **{f"{FIXTURES}/corpus": str(outside)})
    prefect_logs.clear()
    with temporary_settings({PREFECT_API_URL: prefect_server}), pytest.raises(SpecError):
        lifecycle(spec_yaml=reading.read_text(), spec_path=str(reading), base_dir=str(specs), store_root=str(store),
                  until=["ingest:notes"])
    assert "outside the folders this worker reads" in prefect_logs.text and "Traceback" not in prefect_logs.text
