"""Names and store roots a run could not live with are refused at validation (exit 2, file:line, nothing
written): a name so long that its artifact folders pass the file system's 255 bytes, a store root that is `/` or a
system folder, and a store inside a local source folder (its manifests and shards would be ingested)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import Cli, base_env, write_minimal_spec


def _refused(tmp_path: Path, spec: Path, command: str = "validate") -> str:
    work = tmp_path / "work"
    work.mkdir(exist_ok=True)
    env = base_env(tmp_path / "home") | {"COLUMNS": "400"}  # long temporary paths on one line, however run
    done = Cli(work, env)(command, str(spec), check=False, timeout=300)
    assert done.returncode == 2, done.stdout[-1000:] + done.stderr[-2000:]
    assert "Traceback" not in done.stderr + done.stdout
    assert not list(work.iterdir())  # nothing written
    return done.stderr


def _line(spec: Path, text: str) -> int:
    return spec.read_text()[:spec.read_text().index(text)].count("\n") + 1


def test_a_300_character_source_name_is_refused_at_its_line(tmp_path: Path):
    long = "n" * 300
    spec = write_minimal_spec(tmp_path, **{"      - name: notes": f"      - name: {long}",
                                           "notes: 0.7": f"{long}: 0.7"})
    stderr = _refused(tmp_path, spec)
    assert f"{spec}:{_line(spec, long)}: what.data.sources[0].name: String should have at most 64 characters" \
        in stderr


@pytest.mark.parametrize("root", ["/", "/etc", "/usr/local/compass", "file:///proc/store"])
def test_a_store_root_in_the_system_folders_is_refused(tmp_path: Path, root: str):
    spec = write_minimal_spec(tmp_path, **{"how:\n": f"how:\n  storage: {{root: {root}}}\n"})
    stderr = _refused(tmp_path, spec)
    assert f"{spec}:{_line(spec, 'storage:')}: how.storage.root" in stderr and "a store writes and deletes" in stderr


def test_a_store_inside_a_local_source_folder_is_refused(tmp_path: Path):
    source = tmp_path / "corpus"
    source.mkdir()
    (source / "a.txt").write_text("A document of the local source.")
    spec = write_minimal_spec(tmp_path, **{"how:\n": f"how:\n  storage: {{root: {source / 'store'}}}\n"})
    spec.write_text(spec.read_text().replace(spec.read_text().split("uri: ")[1].split("\n")[0], str(source), 1))
    stderr = _refused(tmp_path, spec, "plan")
    assert f"how.storage.root: the store {source / 'store'} lies inside the local source 'notes'" in stderr
    assert "put the store outside the source folder" in stderr


def test_paths_with_brackets_are_printed_as_written(tmp_path: Path):
    """Rich reads `[...]` as markup: a spec folder named `a[/x]b` once crashed the CLI with a MarkupError, and
    `[bold]` in a path would vanish from what is printed."""
    folder = tmp_path / "a[/x]b[bold]"  # a folder `a[` and, inside it, `x]b[bold]`
    folder.mkdir(parents=True)
    spec = write_minimal_spec(folder)
    cli = Cli(folder, base_env(tmp_path / "home") | {"COLUMNS": "400"})
    validated = cli("validate", str(spec))
    assert f"ok {spec}: 'minimal'" in validated.stdout
    planned = cli("plan", str(spec), "--store", str(folder / "store"))
    assert f"compass plan {spec}: 'minimal'" in planned.stdout and "Traceback" not in planned.stderr
    spec.write_text(spec.read_text().replace("num_layers: 2", "num_layers: -2"))
    refused = cli("validate", str(spec), check=False)
    assert refused.returncode == 2 and f"1 problem in {spec}; nothing was run or written." in refused.stderr
