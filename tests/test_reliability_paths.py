"""A spec submitted to a shared worker reads local files only under the worker's allowed roots."""

from __future__ import annotations

from pathlib import Path

import pytest

from compass.flows.server.confinement import allowed_roots, outside_roots
from compass.specs import load_spec
from tests.conftest import REPO, write_minimal_spec


def test_local_sources_outside_the_allowed_roots_are_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    spec_path = write_minimal_spec(tmp_path)  # its sources are absolute paths into the repository's fixtures
    spec = load_spec(spec_path).spec
    monkeypatch.delenv("COMPASS_ALLOWED_ROOTS", raising=False)
    roots = allowed_roots(tmp_path, str(tmp_path / "store"))
    issues = list(outside_roots(spec, tmp_path, roots))
    assert [i.loc for i in issues] == [("what", "data", "sources", 0, "uri"), ("what", "data", "sources", 1, "uri")]
    assert "outside the folders this worker reads" in issues[0].message and str(tmp_path) in issues[0].message
    assert "COMPASS_ALLOWED_ROOTS" in issues[0].hint
    monkeypatch.setenv("COMPASS_ALLOWED_ROOTS", str(REPO / "tests" / "fixtures"))
    assert not list(outside_roots(spec, tmp_path, allowed_roots(tmp_path, str(tmp_path / "store"))))


def test_a_symlink_out_of_the_spec_folder_does_not_get_through(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delenv("COMPASS_ALLOWED_ROOTS", raising=False)
    (tmp_path / "data").symlink_to(REPO / "tests" / "fixtures" / "corpus" / "en")
    spec_path = write_minimal_spec(tmp_path, **{f"{REPO}/tests/fixtures/corpus/en": "data"})
    spec = load_spec(spec_path).spec
    issues = list(outside_roots(spec, tmp_path, allowed_roots(tmp_path, "s3://bucket/store")))
    assert any(i.loc[3] == 0 and "fixtures/corpus/en" in i.message for i in issues)  # resolved through the link
