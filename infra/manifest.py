"""The lineage manifest every committed artifact carries (written last: its presence means committed)."""

from __future__ import annotations

import platform
import socket
import subprocess
from functools import cache
from importlib import metadata
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from compass.infra.errors import DamagedArtifact
from compass.infra.resource_ledger import Resources

MANIFEST = "manifest.json"
TRACKED_LIBRARIES = ("compass-lifecycle", "torch", "deepspeed", "prefect", "datatrove", "tokenizers", "transformers",
                     "trl", "lighteval", "s3fs", "ray", "pydantic")


class InputRef(BaseModel):
    role: str
    step: str
    uri: str
    fingerprint: str


def stays_inside(relative: str) -> bool:
    """Whether a relative path (a manifest entry, an object key under a prefix) names something inside its folder:
    an absolute path or a '..' part would make a check read, or a copy write, outside it."""
    if not relative or "\0" in relative or relative.startswith("/"):
        return False
    return all(part not in ("", ".", "..") for part in relative.split("/"))


class DamagedManifest(DamagedArtifact):
    """A manifest that cannot describe its artifact (unparsable, truncated, an entry outside its folder, another
    artifact's, or in a folder that is a link): the artifact is damaged like one whose files changed."""


class FileEntry(BaseModel):
    path: str
    size: int
    sha256: str

    @field_validator("path")
    @classmethod
    def _inside_the_artifact(cls, path: str) -> str:
        if not stays_inside(path):
            raise ValueError(f"{path!r} leaves the artifact's folder (absolute, or an empty, '.' or '..' part)")
        return path


class ShardSet(BaseModel):
    """A folder of many files listed in a sidecar index instead of the manifest (infra/shard_index.py): the
    manifest keeps the folder's count, bytes and the index's sha256 (which covers the shard list and every shard's
    digest), so it stays small at a million shards. The index is itself one of the manifest's files."""

    folder: str
    count: int
    bytes: int
    index: str
    sha256: str


class Execution(BaseModel):
    """Where the step ran: its placement's mode (in_process, local_ranks, ray_tasks, in_slurm_job), its shape, and
    inside a Slurm job the job's id and nodes."""

    mode: str
    nodes: int = 1
    devices_per_node: int = 0
    slurm_job: str | None = None
    node_list: str | None = None


class Manifest(BaseModel):
    """What a step produced and everything needed to trace and reproduce it."""

    model_config = ConfigDict(extra="forbid")

    kind: str
    name: str
    fingerprint: str
    uri: str
    config: dict[str, Any]
    # the `how` fields the step's kind reads, by dotted path, as it ran: the "results" ones are part of its
    # fingerprint; the others say under what placement it was made (specs/how.py classifies them)
    how: dict[str, Any] = Field(default_factory=dict)
    inputs: list[InputRef] = Field(default_factory=list)
    spec_hash: str
    spec_name: str
    code_version: str
    phase_version: str
    libraries: dict[str, str]
    host: str
    python: str
    started_at: float
    finished_at: float
    metrics: dict[str, Any] = Field(default_factory=dict)
    provenance: list[dict[str, Any]] = Field(default_factory=list, description="Raw sources: package, sha256...")
    files: list[FileEntry] = Field(default_factory=list)
    shard_sets: list[ShardSet] = Field(default_factory=list)
    execution: Execution | None = None
    # what the step read, copied, wrote, uploaded, listed, submitted and published (infra/resource_ledger.py)
    resources: Resources | None = None

    @property
    def step_id(self) -> str:
        return f"{self.kind}:{self.name}"

    @property
    def file_count(self) -> int:
        """Every file of the artifact, those of its shard sets included."""
        return len(self.files) + sum(s.count for s in self.shard_sets)

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files) + sum(s.bytes for s in self.shard_sets)

    @property
    def duration_s(self) -> float:
        return self.finished_at - self.started_at


def parse_manifest(data: bytes | str, where: str) -> Manifest:
    """A manifest read from `where` (an artifact's URI), or DamagedManifest naming the first problem: a damaged
    manifest must end in one line about that artifact, not in a validation traceback that stops every run."""
    try:
        return Manifest.model_validate_json(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        field = ".".join(str(part) for part in first["loc"]) or "the file"
        more = f" (and {exc.error_count() - 1} more)" if exc.error_count() > 1 else ""
        raise DamagedManifest(f"{where}/{MANIFEST}: not a readable manifest: {field}: {first['msg']}{more}") from None


@cache
def library_versions() -> dict[str, str]:
    out = {}
    for lib in TRACKED_LIBRARIES:
        try:
            out[lib] = metadata.version(lib)
        except metadata.PackageNotFoundError:
            continue
    return out


DISTRIBUTION = "compass-lifecycle"


@cache
def code_version() -> str:
    """The git commit of the compass checkout this code runs from ('+dirty' with local changes), or, installed
    from a wheel, the distribution's version. The checkout is the folder holding compass's own packages, and
    only counts when it is the top of its git work tree (an install inside another repository is not one)."""
    checkout = Path(__file__).resolve().parent.parent

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=checkout, capture_output=True, text=True, timeout=5,
                              check=True).stdout.strip()

    try:
        if Path(git("rev-parse", "--show-toplevel")).resolve() == checkout:
            dirty = git("status", "--porcelain", "--untracked-files=no")
            return git("rev-parse", "HEAD") + ("+dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        pass
    try:
        return f"{DISTRIBUTION}=={metadata.version(DISTRIBUTION)}"
    except metadata.PackageNotFoundError:
        return "unknown"


def host_facts() -> dict[str, str]:
    return {"host": socket.gethostname(), "python": platform.python_version()}


def relocated(manifest: Manifest, where: str) -> Manifest:
    """The manifest of an artifact found at `where`: a store copied or moved elsewhere (another folder, another
    bucket) keeps working, with its own URI and its inputs' URIs moved by the same prefix."""
    if manifest.uri == where:
        return manifest
    depth = 2  # <root>/<kind>/<name>-<fp>
    old_root, new_root = manifest.uri.rsplit("/", depth)[0], where.rstrip("/").rsplit("/", depth)[0]
    inputs = [ref.model_copy(update={"uri": new_root + ref.uri[len(old_root):]})
              if ref.uri.startswith(old_root + "/") else ref for ref in manifest.inputs]
    return manifest.model_copy(update={"uri": where.rstrip("/"), "inputs": inputs})
