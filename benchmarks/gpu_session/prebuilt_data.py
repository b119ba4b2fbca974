"""pytest plugin for a GPU node that cannot run the minimal spec's data steps (no datatrove, spaCy there):
`pytest -p prebuilt_data` (this folder on sys.path) fills the `data_store` fixture (tests/conftest.py) with the
artifacts that benchmarks/gpu_session/build_data.py built on a machine that can, instead of running the steps.

The artifacts are installed under this machine's own fingerprints: the plan is compiled here (this checkout's
absolute fixture paths, this node's libraries), each artifact is copied to the folder its step's fingerprint
names, and its manifest (fingerprint, URI, inputs' fingerprints and URIs) is rewritten to match; the files
themselves are unchanged and verified against their manifests' sha256 afterwards. Every other use of conftest's
`_prepare` (a seeded store, edited spec) runs as before.

COMPASS_PREBUILT_DATA: the folder build_data.py wrote (default: <repo>/.devkit/data).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

ENV = "COMPASS_PREBUILT_DATA"
_installed: list[str] = []  # lines for the terminal summary
_patched: list[str] = []


def source() -> Path:
    return Path(os.environ.get(ENV) or Path(__file__).resolve().parents[2] / ".devkit" / "data")


def install(folder: Path, conftest: ModuleType) -> None:
    """What `_prepare(folder, DATA_KINDS)` leaves, from the prebuilt artifacts: folder/spec.yaml and folder/store."""
    from compass.flows.compiler import compile_spec
    from compass.infra.manifest import MANIFEST
    from compass.infra.store import Store, artifact_folder
    from compass.infra.verify import damage
    from compass.specs import load_spec

    src = source()
    if not (src / "data.json").exists():
        raise RuntimeError(f"prebuilt_data: no {src}/data.json: build it with benchmarks/gpu_wheels.sh "
                           f"(benchmarks/gpu_session/build_data.py) and carry .devkit")
    info = json.loads((src / "data.json").read_text())
    theirs: dict[str, str] = info["fingerprints"]
    plan = compile_spec(load_spec(conftest.write_minimal_spec(folder)).spec).up_to(list(conftest.DATA_KINDS))
    ours = {s.id: plan.fingerprints[s.id] for s in plan.steps}
    if set(ours) != set(theirs):
        raise RuntimeError(f"prebuilt_data: the plan's data steps {sorted(ours)} are not the prebuilt ones "
                           f"{sorted(theirs)}: rebuild .devkit/data")
    store_dir = folder / "store"
    store_dir.mkdir(parents=True, exist_ok=True)
    store = Store(str(store_dir))

    def uri(step_id: str) -> str:
        kind, name = step_id.split(":")
        return store.uri(kind, name, ours[step_id])

    for step_id, fp in ours.items():
        kind, name = step_id.split(":")
        old = src / "store" / artifact_folder(kind, name, theirs[step_id])
        new = store_dir / artifact_folder(kind, name, fp)
        shutil.copytree(old, new)
        manifest: dict[str, Any] = json.loads((new / MANIFEST).read_text())
        manifest.update(fingerprint=fp, uri=uri(step_id))
        for ref in manifest["inputs"]:
            ref.update(fingerprint=ours[ref["step"]], uri=uri(ref["step"]))
        (new / MANIFEST).write_text(json.dumps(manifest, indent=2))
        renamed = "" if fp == theirs[step_id] else f" (built as {theirs[step_id][:12]})"
        _installed.append(f"{step_id} -> {new.relative_to(folder)}{renamed}")
    problems = [f"{step_id}: {p}" for step_id in ours for p in damage(store, uri(step_id), "full")]
    shutil.rmtree(store_dir / ".verified", ignore_errors=True)  # damage()'s stamps: not part of a prepared store
    if problems:
        raise RuntimeError("prebuilt_data: installed artifacts do not verify:\n" + "\n".join(problems))


def _patch(module: Any) -> None:
    """Route conftest's `_prepare(folder, DATA_KINDS)` (the data_store fixture) to `install`."""
    try:
        path = str(getattr(module, "__file__", "") or "")
    except Exception:  # noqa: BLE001 (anything in sys.modules: a lazy module may raise on any attribute)
        return
    if not path.endswith(os.path.join("tests", "conftest.py")) or not hasattr(module, "DATA_KINDS"):
        return
    original = getattr(module, "_prepare", None)
    if original is None or getattr(original, "prebuilt", False):
        return

    def _prepare(folder: Path, until: Any, seed: Path | None = None, **replacements: str) -> None:
        if seed is None and not replacements and set(until) == set(module.DATA_KINDS):
            return install(Path(folder), module)
        return original(folder, until, seed, **replacements)

    _prepare.prebuilt = True  # type: ignore[attr-defined]
    module._prepare = _prepare
    _patched.append(f"{module.__name__} ({path})")


def pytest_plugin_registered(plugin: Any, manager: Any) -> None:
    _patch(plugin)


def pytest_sessionstart(session: pytest.Session) -> None:
    import sys

    for module in [*session.config.pluginmanager.get_plugins(), *list(sys.modules.values())]:
        _patch(module)


def pytest_report_header(config: pytest.Config) -> str:
    src = source()
    built = json.loads((src / "data.json").read_text()) if (src / "data.json").exists() else {}
    where = f"{src}, built {built.get('built_at', '?')} with python {built.get('python', '?')}" if built else \
        f"{src} MISSING"
    return f"prebuilt_data: data_store from {where}; conftest patched: {', '.join(_patched) or 'not yet'}"


def pytest_terminal_summary(terminalreporter: Any) -> None:
    terminalreporter.write_sep("=", "prebuilt data")
    if not _patched:
        terminalreporter.write_line("tests/conftest.py was never seen: its _prepare ran unchanged")
    elif not _installed:
        terminalreporter.write_line("data_store was not asked for (no test used it)")
    for line in _installed:
        terminalreporter.write_line(line)
