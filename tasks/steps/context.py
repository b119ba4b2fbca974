"""The contract between the runner and a step kind: what a step gets (StepContext) and gives back (StepResult)."""

from __future__ import annotations

import logging
import shutil
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, Generic, TypeVar

from compass.infra import resource_ledger
from compass.infra.manifest import FileEntry, Manifest
from compass.infra.store import Store
from compass.specs.how import How
from compass.tasks.steps.placement import HERE, Placement
from compass.tasks.steps.step_config import StepConfig
from compass.tasks.steps.wiring import Inputs

ConfigT = TypeVar("ConfigT", bound=StepConfig)
GivenInputs = TypeVar("GivenInputs", bound=Inputs)


@dataclass(frozen=True)
class Runtime:
    """What a step runs under besides its config: the spec's `how` (hardware, parallelism, precision, kernels,
    checkpoints, orchestration; the fields of it that change what the step produces are in its fingerprint through
    StepKind.reads_how, the rest never are), the folder relative paths resolve against, and where this step runs
    (its placement: tasks/steps/placement.py)."""

    how: How = field(default_factory=How)
    base_dir: Path = field(default_factory=Path.cwd)
    run: str = "compass"  # the spec's name: labels metrics, names the monitoring folder
    placement: Placement = HERE

    def monitoring_dir(self, store: Store | None, workdir: Path) -> Path:
        """Where a run's live telemetry goes: targets for Prometheus, TensorBoard runs (how.monitoring.folder)."""
        folder = self.how.monitoring.folder
        if folder:
            return (self.base_dir / Path(folder).expanduser()).resolve()
        return store.monitoring_dir(self.run) if store is not None else workdir / "monitoring"


@dataclass
class InputArtifact:
    """A committed artifact a step reads. What it hands the step (a folder, a sub-folder, one file) is counted in
    the step's resource ledger as read, by role and top folder: a step asks for the part it needs
    (`local(only=...)`), and the ledger shows when it takes more."""

    role: str
    step_id: str
    uri: str
    manifest: Manifest
    store: Store
    # the files (and shard sets) already counted: a part handed to the step twice (a stage's history, read when the
    # job is built and again when its metrics are continued) is one read of the store
    _counted: set[str] = field(default_factory=set, init=False, repr=False, compare=False)

    def local(self, *parts: str) -> Path:
        """The artifact's folder on local disk (downloaded and verified first when the store is remote); `parts`:
        just those of its top-level folders and files (the held-out split and its metadata, the final weights),
        the rest neither copied nor counted as read."""
        if not parts:
            self._read(None)
            return self.store.local_path(self.uri)
        for part in parts:
            self._read(part)
        wanted = tuple(parts)
        return self.store.local_path(self.uri, select=lambda path: path.split("/", 1)[0] in wanted)

    def local_files(self, files: set[str]) -> Path:
        """The artifact's folder on local disk holding just `files` (artifact-relative paths: a sample of a split's
        shards): from a remote store only they are downloaded, and only they are counted as read."""
        self._read_files(files)
        return self.store.local_path(self.uri, select=lambda path: path in files)

    def local_folder(self, under: str) -> Path:
        """One sub-folder of the artifact on local disk (one checkpoint of a model): from a remote store only its
        files are downloaded, and only they are counted as read. `release` removes that download."""
        self._read(under)
        return self.store.local_path(self.uri, only=under) / under

    def release(self, folder: Path, under: str) -> None:
        """Remove a remote store's download of `under` (from `local_folder`) once it is used: a step that reads
        170 checkpoints one after another keeps one on local disk, not all of them. A local store's folder stays."""
        if self.store.is_remote:
            shutil.rmtree(folder.parents[len(Path(under).parts) - 1], ignore_errors=True)

    def folder_url(self, under: str) -> str:
        """Its sub-folder `under` where readers such as datatrove's stream it from (no copy; the runner checked
        the files against the manifest before the step: infra/verify.py)."""
        self._read(under)
        return self.store.folder_url(self.uri, under)

    def files(self, under: str, suffix: str = "") -> list[FileEntry]:
        """The committed files under the folder `under` (ending with `suffix`), in path order."""
        return [e for e in self.store.entries(self.manifest, under) if e.path.endswith(suffix)]

    def open(self, entry: FileEntry) -> AbstractContextManager[BinaryIO]:
        """One of its files streamed from the store, no whole-artifact copy (Store.open_committed)."""
        self._count(entry.path.split("/", 1)[0] if "/" in entry.path else ".", entry.size)
        return self.store.open_committed(self.uri, entry)

    def _read(self, under: str | None) -> None:
        """Count the files under `under` (all: None) as read; a shard set by its recorded bytes, without reading
        its index (a million shards must not cost a million entries here)."""
        if resource_ledger.current() is None:
            return
        prefix = under.strip("/") + "/" if under else ""
        by_folder: dict[str, int] = {}

        def add(path: str, size: int) -> None:
            top = path.split("/", 1)[0] if "/" in path else "."
            by_folder[top] = by_folder.get(top, 0) + size

        def once(path: str, size: int) -> None:
            if path not in self._counted:
                self._counted.add(path)
                add(path, size)

        for entry in self.manifest.files:
            if entry.path.startswith(prefix) or entry.path == under:
                once(entry.path, entry.size)
        for shards in self.manifest.shard_sets:
            if f"{shards.folder}/".startswith(prefix):
                once(f"{shards.folder}/", shards.bytes)
            elif prefix.startswith(f"{shards.folder}/"):  # a sub-folder of a shard set: its members there
                for entry in self.store.shard_members(self.manifest, shards.folder):
                    if entry.path.startswith(prefix):
                        once(entry.path, entry.size)
        for folder, size in by_folder.items():
            self._count(folder, size)

    def _read_files(self, files: set[str]) -> None:
        """Count `files` as read (each once per step), by top folder, a shard set's members from its index."""
        if resource_ledger.current() is None:
            return
        by_folder: dict[str, int] = {}
        entries = list(self.manifest.files)
        for shards in self.manifest.shard_sets:
            if any(path.startswith(f"{shards.folder}/") for path in files):
                entries += self.store.shard_members(self.manifest, shards.folder)
        for entry in entries:
            if entry.path in files and entry.path not in self._counted:
                self._counted.add(entry.path)
                top = entry.path.split("/", 1)[0] if "/" in entry.path else "."
                by_folder[top] = by_folder.get(top, 0) + entry.size
        for folder, size in by_folder.items():
            self._count(folder, size)

    def _count(self, folder: str, size: int) -> None:
        ledger = resource_ledger.current()
        if ledger is not None:
            ledger.read(self.role, folder, size)


@dataclass
class StepContext(Generic[ConfigT]):
    """`out` becomes the artifact; `scratch` is working space deleted when the step ends; `workdir` survives
    a crash of the step (checkpoints live there) and is removed once the artifact is committed."""

    kind: str
    name: str
    config: ConfigT
    inputs: dict[str, InputArtifact]
    out: Path
    scratch: Path
    workdir: Path
    runtime: Runtime
    log: logging.Logger | logging.LoggerAdapter
    store: Store | None = None
    work_key: str = ""  # <kind>/<name>-<fingerprint[:12]>: names this step's recovery copies in the store
    spec_hash: str = ""  # the spec's run: groups its steps' tracker runs
    uri: str = ""  # where the artifact will be committed
    # files the step's writers put straight into the artifact's folder on a remote store, with the digests they
    # recorded as they wrote them (tasks/data/places.py): the commit lists them without reading them back
    published: list[FileEntry] = field(default_factory=list)

    def given(self, inputs: type[GivenInputs]) -> GivenInputs:
        """The step's inputs as its kind declared them (its Inputs class), each field the committed artifact:
        `ctx.given(TrainingInputs).previous`, not `ctx.inputs["previous"]`."""
        return inputs.given(self.inputs)


@dataclass
class StepResult:
    """What a step reports: metrics go into the manifest; summary and tables become Prefect artifacts."""

    metrics: dict[str, Any] = field(default_factory=dict)
    summary: str = ""
    tables: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    provenance: list[dict[str, Any]] = field(default_factory=list)
