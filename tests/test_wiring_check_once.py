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
    from compass.flows.cli import app
    from compass.specs import source_listing

    listed, machine_checked = [], []
    real_listing, real_machine = source_listing.listing_digest, validation._machine

    def listing(folder: Path, *args):
        listed.append(folder)
        return real_listing(folder, *args)

    def machine(*args, **kwargs):
        machine_checked.append(args[0].name)
        return real_machine(*args, **kwargs)

    monkeypatch.setattr(source_listing, "listing_digest", listing)
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
