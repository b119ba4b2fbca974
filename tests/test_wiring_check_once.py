"""A run checks its spec once (issue 42, part 6): `compass run` loads and checks the spec, then hands it to the flow
it starts in the same process, which used to load and check it again: every local source folder listed twice (on a
cluster's shared filesystem, a corpus of many files), the Hugging Face cache and S3 asked twice."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import seeded, write_minimal_spec


@pytest.mark.slow
def test_compass_run_lists_the_sources_and_checks_the_machine_once(prefect_server: str, data_store: Path,
                                                                    tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    from prefect.settings import PREFECT_API_URL, temporary_settings
    from typer.testing import CliRunner

    from compass.flows import validation
    from compass.flows.cli.app import app
    from compass.specs import input_stamps

    listed, machine_checked = [], []
    real_listing, real_machine = input_stamps.listing_digest, validation._machine

    def listing(folder: Path, *args):
        listed.append(folder)
        return real_listing(folder, *args)

    def machine(*args, **kwargs):
        machine_checked.append(args[0].name)
        return real_machine(*args, **kwargs)

    monkeypatch.setattr(input_stamps, "listing_digest", listing)
    monkeypatch.setattr(validation, "_machine", machine)
    monkeypatch.chdir(tmp_path)
    spec = write_minimal_spec(tmp_path)
    store = seeded(tmp_path / "store", data_store)
    with temporary_settings({PREFECT_API_URL: prefect_server}):
        done = CliRunner().invoke(app, ["run", str(spec), "--store", str(store), "--until", "curate:notes",
                                        "--json"])
    assert done.exit_code == 0, done.output
    summary = json.loads(done.stdout[done.stdout.index("{"):])
    assert {s["step"] for s in summary["steps"]} == {"ingest:notes", "curate:notes"}  # found committed: cached
    assert not any(s["executed"] for s in summary["steps"])
    assert machine_checked == ["minimal"], machine_checked  # once, by `compass run`: not again by its flow
    assert len(listed) == len(set(listed)) > 0, listed  # each local source folder listed once


_AUDITED: list[tuple[str, tuple]] = []
_LISTENING: list[bool] = []
WORLD_EVENTS = ("open", "os.listdir", "os.scandir", "os.walk", "glob.glob", "socket.connect", "socket.getaddrinfo",
                "subprocess.Popen", "os.system", "os.exec", "os.posix_spawn")


def _audit(event: str, args: tuple) -> None:
    """Records the reads of the world; a library looking into its own installed files (ruamel.yaml globs for its
    plug-ins whenever a YAML parser is made) is not one."""
    import sys

    if not _LISTENING or not event.startswith(WORLD_EVENTS):
        return
    first = str(args[0]) if args else ""
    if not first.startswith((sys.prefix, sys.base_prefix)):
        _AUDITED.append((event, args[:1]))


def test_parsing_a_spec_reads_nothing_and_resolving_it_reads_its_sources(tmp_path: Path):
    """parse_spec_text is pure (the YAML and the schema); the loader's reads of the world are resolve_facts's, and
    there it lists the local source folders whose listings enter the ingest steps' identity."""
    import sys

    from compass.specs.loader import check_loaded, parse_spec_text, resolve_facts

    text = write_minimal_spec(tmp_path).read_text()
    parse_spec_text(text, "spec.yaml", tmp_path)  # imports what it needs (imports open files) before listening
    if _audit not in getattr(sys, "_compass_audit_hooks", ()):
        sys.addaudithook(_audit)  # hooks cannot be removed: this one records only while _LISTENING
        sys._compass_audit_hooks = (*getattr(sys, "_compass_audit_hooks", ()), _audit)  # type: ignore[attr-defined]
    _AUDITED.clear()
    _LISTENING.append(True)
    try:
        parsed = parse_spec_text(text, "spec.yaml", tmp_path)
        during_parse = list(_AUDITED)
        resolved = resolve_facts(parsed)
    finally:
        _LISTENING.clear()
    assert during_parse == []
    listed = [event for event, _ in _AUDITED if event in ("os.scandir", "os.listdir", "glob.glob")]
    assert listed, _AUDITED  # the hook hears the reads it is there to catch
    assert all(s.listing is None for s in parsed.spec.what.data.sources)
    assert all(s.listing for s in resolved.spec.what.data.sources)
    assert check_loaded(resolved).spec_hash == resolved.spec_hash
