"""Names the installed distributions whose wheel is not the one pip would choose from the local wheel sources.

uv, asked for the best version across indexes, takes a version's files from the first index that holds it; pip
takes the file whose tags this interpreter ranks highest across all of them. Where a local mirror holds only an
older Python's wheel (multiprocess's py310 wheel on Python 3.11, whose workers then die in fork_exec) or only the
pure-Python fallback (tensorboard-data-server without its server binary), the two differ. infra/setup.sh installs
what this prints again with pip. Only local sources (file:// indexes and find-links folders) are read: fast, and
the ones where the difference arises.

Usage: python infra/wheel_choice.py SOURCE...   (each a file:// simple index, a folder, or a URL, which is skipped)
"""

from __future__ import annotations

import re
import sys
from importlib.metadata import distributions
from pathlib import Path
from urllib.parse import unquote, urlparse

from packaging.tags import Tag, parse_tag, sys_tags
from packaging.utils import InvalidWheelFilename, canonicalize_name, parse_wheel_filename

WHEEL_LINK = re.compile(r'href="([^"#]+\.whl)')


def local_folder(source: str) -> Path | None:
    """A source's folder on this machine, or None for a remote index."""
    if source.startswith("file://"):
        return Path(unquote(urlparse(source).path))
    if "://" in source:
        return None
    return Path(source)


def wheel_names(sources: list[str], project: str) -> list[str]:
    """Every wheel file name the local sources offer for one project."""
    names: list[str] = []
    for source in sources:
        folder = local_folder(source)
        if folder is None or not folder.is_dir():
            continue
        page = folder / project / "index.html"
        if page.is_file():  # a simple index
            names += [link.rsplit("/", 1)[-1] for link in WHEEL_LINK.findall(page.read_text(errors="replace"))]
        else:  # a find-links folder of wheels
            names += [p.name for p in folder.glob("*.whl")]
    return names


def rank(tags: frozenset[Tag], priority: dict[Tag, int]) -> int | None:
    """How this interpreter ranks a wheel's tags (lower is preferred, as pip prefers); None where none fits."""
    ranks = [priority[tag] for tag in tags if tag in priority]
    return min(ranks) if ranks else None


def misplaced(sources: list[str], site: list[str] | None = None) -> list[str]:
    """`name==version` for each installed wheel (in `site`, default sys.path) that a better-ranked local wheel of the
    same version would replace."""
    priority = {tag: i for i, tag in enumerate(sys_tags())}
    out: list[str] = []
    for dist in distributions(path=site if site is not None else sys.path):
        wheel = dist.read_text("WHEEL") or ""
        installed = frozenset(t for line in wheel.splitlines() if line.startswith("Tag:")
                              for t in parse_tag(line.split(":", 1)[1].strip()))
        have = rank(installed, priority)
        if have is None and installed:
            have = len(priority)  # a wheel this interpreter would not choose at all
        if have is None:
            continue  # not installed from a wheel's tags (an editable install)
        name = canonicalize_name(dist.metadata["Name"])
        best = have
        for file_name in wheel_names(sources, name):
            try:
                project, version, _, tags = parse_wheel_filename(file_name)
            except InvalidWheelFilename:
                continue
            offered = rank(tags, priority)
            if project == name and str(version) == dist.version and offered is not None and offered < best:
                best = offered
        if best < have:
            out.append(f"{dist.metadata['Name']}=={dist.version}")
    return sorted(out)


if __name__ == "__main__":
    print("\n".join(misplaced(sys.argv[1:])))
