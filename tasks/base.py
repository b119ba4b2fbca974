"""The contract between the runner and a phase: what a step gets (StepContext) and gives back (StepResult)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from compass.infra.manifest import Manifest
from compass.infra.store import Store


@dataclass(frozen=True)
class Runtime:
    """Settings from `how` that change how a step runs but never what it produces (not fingerprinted)."""

    workers: int = 2
    task_runner: str = "local"
    ray_address: str | None = None
    base_dir: Path = Path.cwd()
    how: dict = field(default_factory=dict)  # the spec's `how`, for hardware and parallelism


@dataclass
class InputArtifact:
    role: str
    step_id: str
    uri: str
    manifest: Manifest
    store: Store

    def local(self) -> Path:
        """The artifact's files on local disk (downloaded and verified first when the store is remote)."""
        return self.store.local_path(self.uri)


@dataclass
class StepContext:
    """`out` becomes the artifact; `scratch` is working space deleted when the step ends; `workdir` survives
    a crash of the step (checkpoints live there) and is removed once the artifact is committed."""

    kind: str
    name: str
    config: dict[str, Any]
    inputs: dict[str, InputArtifact]
    out: Path
    scratch: Path
    workdir: Path
    runtime: Runtime
    log: logging.Logger | logging.LoggerAdapter
    store: Store | None = None
    work_key: str = ""  # <kind>/<name>-<fingerprint[:12]>: names this step's recovery copies in the store

    def inputs_with_prefix(self, prefix: str) -> dict[str, InputArtifact]:
        return {role[len(prefix):]: art for role, art in self.inputs.items() if role.startswith(prefix)}


@dataclass
class StepResult:
    """What a step reports: metrics go into the manifest; summary and tables become Prefect artifacts."""

    metrics: dict[str, Any] = field(default_factory=dict)
    summary: str = ""
    tables: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    provenance: list[dict[str, Any]] = field(default_factory=list)
