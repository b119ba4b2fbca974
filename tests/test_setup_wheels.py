"""The set-up installs again, with pip, each wheel uv took that pip would not have (infra/wheel_choice.py)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

from packaging.tags import sys_tags

from tests.conftest import REPO

spec = importlib.util.spec_from_file_location("wheel_choice", REPO / "infra" / "wheel_choice.py")
wheel_choice = importlib.util.module_from_spec(spec)
spec.loader.exec_module(wheel_choice)

HERE = f"py{sys.version_info.major}{sys.version_info.minor}"
OLDER = f"py{sys.version_info.major}{sys.version_info.minor - 1}"
PLATFORM = next(t.platform for t in sys_tags() if t.interpreter == "py3" and t.platform != "any")  # manylinux_2_x


def installed(site: Path, name: str, version: str, tag: str) -> None:
    info = site / f"{name}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    (info / "WHEEL").write_text(f"Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: {tag}\n")


def index(root: Path, name: str, *files: str) -> str:
    page = root / name / "index.html"
    page.parent.mkdir(parents=True)
    page.write_text("".join(f'<a href="../../files/{f}#sha256=00">{f}</a>\n' for f in files))
    return f"file://{root}"


def test_an_older_pythons_wheel_or_a_pure_fallback_is_named_and_the_best_one_is_not(tmp_path: Path):
    site = tmp_path / "site"
    installed(site, "multiprocess", "0.70.19", f"{OLDER}-none-any")  # what uv took from the first index
    installed(site, "tensorboard_data_server", "0.7.2", "py3-none-any")
    installed(site, "dill", "0.4.1", "py3-none-any")  # nothing better offered
    installed(site, "fresh", "1.0", f"{HERE}-none-any")  # already the best
    first = index(tmp_path / "first", "multiprocess", f"multiprocess-0.70.19-{OLDER}-none-any.whl")
    index(tmp_path / "first", "tensorboard-data-server", "tensorboard_data_server-0.7.2-py3-none-any.whl")
    more = index(tmp_path / "more", "multiprocess", f"multiprocess-0.70.19-{HERE}-none-any.whl",
                 f"multiprocess-0.70.18-{HERE}-none-any.whl")
    index(tmp_path / "more", "tensorboard-data-server",
          f"tensorboard_data_server-0.7.2-py3-none-{PLATFORM}.whl")
    index(tmp_path / "more", "fresh", "fresh-1.0-py3-none-any.whl")
    sources = [first, more, "https://index.example/simple", str(tmp_path / "no-such-folder")]

    assert wheel_choice.misplaced(sources, site=[str(site)]) == [
        "multiprocess==0.70.19", "tensorboard_data_server==0.7.2"]
    assert wheel_choice.misplaced([first], site=[str(site)]) == []  # nothing better where uv looked first
