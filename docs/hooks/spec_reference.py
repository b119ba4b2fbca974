"""mkdocs hook: the spec reference page is generated from the spec's pydantic models at every build
(compass.specs.reference), and the build fails on a field or model without a description."""

from __future__ import annotations

from mkdocs.exceptions import PluginError
from mkdocs.structure.files import File, Files

PAGE = "reference/spec.md"


def on_files(files: Files, config) -> Files:
    from compass.specs.reference import render, undocumented

    missing = undocumented()
    if missing:
        raise PluginError(f"{len(missing)} spec fields or models have no description (the reference is generated "
                          f"from them): {', '.join(missing)}. Add description= to each Field, a docstring to each "
                          "model.")
    files.append(File.generated(config, PAGE, content=render()))
    return files
