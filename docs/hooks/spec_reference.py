"""mkdocs hook: the reference pages are generated at every build: the spec's from its pydantic models
(compass.specs.reference; the build fails on a field or model without a description), the command line's from the
commands themselves (compass.flows.cli.reference)."""

from __future__ import annotations

from mkdocs.exceptions import PluginError
from mkdocs.structure.files import File, Files

PAGE = "reference/spec.md"
CLI_PAGE = "reference/cli.md"


def on_files(files: Files, config) -> Files:
    from compass.specs.reference import render, undocumented

    missing = undocumented()
    if missing:
        raise PluginError(f"{len(missing)} spec fields or models have no description (the reference is generated "
                          f"from them): {', '.join(missing)}. Add description= to each Field, a docstring to each "
                          "model.")
    files.append(File.generated(config, PAGE, content=render()))
    from compass.flows.cli.reference import render as render_cli

    files.append(File.generated(config, CLI_PAGE, content=render_cli()))
    return files
