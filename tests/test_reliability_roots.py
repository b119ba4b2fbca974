"""Issue #30, part II, item 7: a run a deployment started reads local files only under the worker's own roots (its
store, the folder it keeps submitted specs in, COMPASS_ALLOWED_ROOTS), however the submitter sets the flow's
`base_dir` and `store_root`.

The flow runs on the test's Prefect server; Prefect's PREFECT__RUNTIME__DEPLOYMENT__ID makes it a deployment's run
(`prefect.runtime.deployment.id`), as a worker's flow run is."""

from __future__ import annotations

import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest

from compass.specs.loader import SpecError
from tests.conftest import FIXTURES, write_minimal_spec


@dataclass(frozen=True)
class Worker:
    store: Path
    specs: Path


@pytest.fixture
def worker(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Worker:
    """This process as a worker's flow run: its store and spec folder configured, no other allowed roots."""
    folders = Worker(tmp_path / "worker-store", tmp_path / "worker-specs")
    folders.specs.mkdir()
    monkeypatch.setenv("PREFECT__RUNTIME__DEPLOYMENT__ID", str(uuid.uuid4()))
    monkeypatch.setenv("COMPASS_WORKER_STORE", str(folders.store))
    monkeypatch.setenv("COMPASS_WORKER_SPECS", str(folders.specs))
    monkeypatch.delenv("COMPASS_ALLOWED_ROOTS", raising=False)
    monkeypatch.chdir(tmp_path)
    return folders


def _spec_reading(data: Path, spec_folder: Path) -> Path:
    """The minimal spec with its sources copied to `data` (the worker's files a submitter wants)."""
    shutil.copytree(FIXTURES / "corpus", data / "corpus")
    return write_minimal_spec(spec_folder, **{f"{FIXTURES}/corpus": str(data / "corpus")})


def _run(prefect_server: str, spec: Path, base_dir: str, store_root: str) -> dict:
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from compass.flows.lifecycle import lifecycle

    with temporary_settings({PREFECT_API_URL: prefect_server}):
        return lifecycle(spec_yaml=spec.read_text(), spec_path=str(spec), base_dir=base_dir, store_root=store_root,
                         until=["ingest:notes"])


@pytest.mark.parametrize("widened", ["base_dir", "store_root"])
def test_flow_parameters_do_not_widen_the_worker_roots(prefect_server: str, worker: Worker, tmp_path: Path,
                                                       widened: str):
    """base_dir '/' (everything) or a store_root over the data: either let the old check read the data."""
    outside = tmp_path / "outside"
    spec = _spec_reading(outside, worker.specs)
    base_dir, store_root = ("/", str(worker.store)) if widened == "base_dir" else (str(worker.specs), str(outside))
    with pytest.raises(SpecError, match="outside the folders this worker reads") as refused:
        _run(prefect_server, spec, base_dir, store_root)
    assert str(outside / "corpus" / "en") in str(refused.value) and str(worker.specs) in str(refused.value)
    assert not list(worker.store.glob("ingest/*")) and not (outside / "ingest").exists()  # nothing was read


def test_the_worker_roots_still_admit_their_own_data(prefect_server: str, worker: Worker):
    """Data in the folder the worker keeps submitted specs in is read, whatever base_dir the submitter gave."""
    spec = _spec_reading(worker.specs, worker.specs)
    summary = _run(prefect_server, spec, "/", str(worker.store))
    assert [s["step"] for s in summary["steps"] if s["executed"]] == ["ingest:notes"]
