"""The documentation site: `mkdocs build --strict` passes (a broken link fails it), its spec reference lists exactly
the fields the spec's JSON Schema has, and a field without a description stops the build."""

from __future__ import annotations

import html
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import REPO, VENV_BIN


def mkdocs_build(project: Path, site: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    return subprocess.run([str(VENV_BIN / "mkdocs"), "build", "--strict", "-f", str(project / "mkdocs.yml"), "-d",
                           str(site)], cwd=project, env=env, capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    site = tmp_path_factory.mktemp("site")
    built = mkdocs_build(REPO, site)
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-5000:]
    return site


def schema_paths(schema: dict[str, Any]) -> set[str]:
    """Every property path of the spec's JSON Schema (what `compass schema` gives editors), `[]` for list items and
    `.<key>` for map values, through $refs and unions: an independent count of the spec's fields."""
    defs = schema.get("$defs", {})
    paths: set[str] = set()

    def walk(node: dict[str, Any], path: str) -> None:
        if "$ref" in node:
            walk(defs[node["$ref"].rsplit("/", 1)[-1]], path)
            return
        for key in ("anyOf", "oneOf", "allOf"):
            for option in node.get(key, []):
                walk(option, path)
        if node.get("type") == "array" and isinstance(node.get("items"), dict):
            walk(node["items"], f"{path}[]")
        if isinstance(node.get("additionalProperties"), dict):
            walk(node["additionalProperties"], f"{path}.<key>")
        for value in node.get("patternProperties", {}).values():  # a map whose keys have a pattern
            walk(value, f"{path}.<key>")
        for name, sub in node.get("properties", {}).items():
            here = f"{path}.{name}" if path else name
            paths.add(here)
            walk(sub, here)

    walk(schema, "")
    return paths


def test_the_site_builds_strictly_with_every_page(site: Path):
    for page in ("index.html", "getting-started/index.html", "reference/spec/index.html",
                 "guides/production/index.html", "guides/monitoring/index.html", "architecture/index.html"):
        assert (site / page).exists(), page


def test_the_reference_lists_exactly_the_schema_fields(site: Path):
    from compass.specs.spec import TrainingSpec

    page = (site / "reference" / "spec" / "index.html").read_text()
    first_cells = re.findall(r"<tr>\s*<td>(.*?)</td>", page, flags=re.S)  # each row's Field cell: its paths
    shown = {html.unescape(m) for cell in first_cells for m in re.findall(r"<code>([^<]+)</code>", cell)}
    expected = schema_paths(TrainingSpec.model_json_schema())
    assert expected - shown == set(), sorted(expected - shown)
    assert shown - expected == set(), sorted(shown - expected)
    assert "how.monitoring.trackers" in shown and "Experiment trackers every training" in page


def test_the_command_line_reference_lists_every_command_and_option(site: Path):
    """Generated from the click tree at every build: a command or option added to the CLI is on the page."""
    import typer.main

    from compass.flows.cli.app import app
    from compass.flows.cli.reference import commands

    page = html.unescape((site / "reference" / "cli" / "index.html").read_text())
    listed = list(commands(typer.main.get_command(app)))
    assert {"compass validate", "compass plan", "compass run", "compass ablate promote", "compass worker"} <= \
        {name for name, _ in listed}
    for name, command in listed:
        assert f"<code>{name}</code>" in page, name
        for param in command.params:
            if param.param_type_name == "option":
                assert param.opts[0] in page, (name, param.opts[0])
    assert "--no-machine-checks" in page and "Machine-readable output." in page


def test_a_broken_link_fails_the_build(tmp_path: Path):
    project = tmp_path / "project"
    shutil.copytree(REPO / "docs", project / "docs")
    shutil.copy(REPO / "mkdocs.yml", project)
    index = project / "docs" / "index.md"
    index.write_text(index.read_text() + "\nSee [the old page](no-such-page.md).\n")
    built = mkdocs_build(project, tmp_path / "site")
    assert built.returncode != 0 and "no-such-page.md" in built.stdout + built.stderr


def test_a_field_without_a_description_stops_the_build(monkeypatch: pytest.MonkeyPatch):
    import importlib.util

    from mkdocs.exceptions import PluginError
    from pydantic import Field

    from compass.specs import reference
    from compass.specs.base import SpecModel

    class Knob(SpecModel):
        """A model of the test's own."""

        documented: int = Field(default=1, description="Says what it does.")
        silent: int = 2

    assert reference.undocumented(Knob) == ["Knob.silent"]
    spec = importlib.util.spec_from_file_location("spec_reference_hook", REPO / "docs" / "hooks" / "spec_reference.py")
    hook = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hook)
    monkeypatch.setattr(reference, "undocumented", lambda root=None: ["Knob.silent"])
    with pytest.raises(PluginError, match="Knob.silent"):
        hook.on_files(None, None)
