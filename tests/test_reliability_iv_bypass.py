"""Issue 80, item 1: one write rule for every place compass writes, whatever form the path takes. Generated over
the schema and the CLI: every path-taking field of the spec and every path option of every command is found by
walking them (a new one fails here until it is said to write or only to read), and each field or option that
writes is tried with each form that reaches a system folder without saying so (`//x`, `/./x`, a relative escape,
a link, a link's own relative form, a `file://` URI): refused, exit 2 for a command, the field or option named (a
spec field with its line), nothing written."""

from __future__ import annotations

import typing
from collections.abc import Iterator
from pathlib import Path

import pytest
import typer
import yaml
from pydantic import BaseModel
from typer.testing import CliRunner

from compass.flows.cli.app import app
from compass.specs.loader import SpecError, load_spec
from compass.specs.spec import TrainingSpec
from tests.conftest import write_minimal_spec
from tests.test_reliability_iii_roots import MINIMAL_HOW

ESCAPE = "/".join([".."] * 16)  # from any folder here up to `/`
PATH_WORDS = ("root", "folder", "cache", "dir", "path", "uri", "file", "store", "staging", "database", "specs")
PATH_OPTIONS = {"--out", "--preflight"}  # path options whose names hold none of those words
TARGET = "compass-bypass-probe"  # a name under /etc that nothing else makes: it must never appear

# what each path-taking spec field does with its path: writes under it (a folder, or a database file's folder), or
# only reads it; the walk below must find exactly these
WRITE_FIELDS = {"how.storage.root": "folder", "how.storage.local_cache": "folder",
                "how.orchestration.cluster.shared_root": "folder", "how.monitoring.folder": "folder",
                "how.monitoring.mlflow_tracking_uri": "database"}
READ_FIELDS = {"what.data.sources.uri", "what.tokenizer.candidates.path"}

# every path option of the CLI: the arguments that try it (V: the path), or None for an option that only reads
SPEC = "SPEC"
WRITE_OPTIONS: dict[tuple[str, str], list[str] | None] = {
    ("run", "--store"): ["run", SPEC, "--store", "V"],
    ("plan", "--store"): ["plan", SPEC, "--store", "V"],
    ("why", "--store"): ["why", "pretrain:stage1", SPEC, "--store", "V"],
    ("monitor", "--store"): ["monitor", SPEC, "--store", "V"],
    ("submit", "--store"): ["submit", SPEC, "--store", "V"],
    ("worker", "--store"): ["worker", "--store", "V"],
    ("evaluate-schedule", "--root"): ["evaluate-schedule", SPEC, "--root", "V", "--once"],
    ("preflight", "--staging"): ["preflight", SPEC, "--staging", "V"],
    ("ablate promote", "--store"): ["ablate", "promote", SPEC, "--store", "V"],
    ("ablate promote", "--out"): ["ablate", "promote", SPEC, "--out", "V/promoted.yaml"],
    ("server", "--database"): ["server", "--database", "sqlite:///V/prefect.db"],
    ("plan", "--preflight"): None,  # reads a preflight's JSON
    ("worker", "--specs"): None,  # where submitted specs may read local files from
}


def spec_path_fields(model: type[BaseModel] = TrainingSpec, prefix: str = "") -> Iterator[str]:
    """Every str field of the spec whose name says it holds a path, as a dotted path (lists and unions walked)."""
    for name, field in model.model_fields.items():
        path, todo, seen = f"{prefix}{name}", [field.annotation], set()
        holds_str = False
        while todo:
            annotation = todo.pop()
            if isinstance(annotation, type) and issubclass(annotation, BaseModel):
                if annotation not in seen:
                    seen.add(annotation)
                    yield from spec_path_fields(annotation, path + ".")
            else:
                holds_str |= annotation is str
                todo.extend(typing.get_args(annotation))
        if holds_str and any(word in name for word in PATH_WORDS):
            yield path


def cli_path_options() -> set[tuple[str, str]]:
    """Every option of every command whose name or type says it takes a path."""
    found: set[tuple[str, str]] = set()

    def walk(command, names: list[str]) -> None:
        if hasattr(command, "commands"):
            for name, sub in command.commands.items():
                walk(sub, [*names, name])
            return
        for param in command.params:
            if param.param_type_name != "option" or param.is_flag:
                continue
            option = param.opts[0]
            if (any(word in option for word in PATH_WORDS) or option in PATH_OPTIONS
                    or "Path" in str(param.type_descriptor)):
                found.add((" ".join(names), option))

    walk(typer.main.get_command(app), [])
    return found


def forms(folder: Path) -> list[str]:
    """Ways to write /etc/<TARGET> that the string alone does not show; relative ones start at `folder`."""
    folder.mkdir(exist_ok=True)
    (folder / "etc-link").symlink_to("/etc")
    return [f"//etc/{TARGET}", f"/./etc/{TARGET}", f"{ESCAPE}/etc/{TARGET}", f"{folder}/x/../{ESCAPE}/etc/{TARGET}",
            f"{folder}/etc-link/{TARGET}", f"etc-link/{TARGET}", f"file:///etc/{TARGET}"]


def test_the_walks_find_every_path_field_and_option_said_to_write_or_to_read():
    assert set(spec_path_fields()) == set(WRITE_FIELDS) | READ_FIELDS
    assert cli_path_options() == set(WRITE_OPTIONS)


def spec_setting(folder: Path, field: str, value: str) -> tuple[Path, int]:
    """The minimal spec with `field` set to `value` (its sections nested as the dotted path says); the line it is on."""
    nested: object = value
    for part in reversed(field.split(".")[1:]):
        nested = {part: nested}
    lines = yaml.safe_dump(nested, default_flow_style=False, width=1000).splitlines()
    spec = write_minimal_spec(folder, **{MINIMAL_HOW: MINIMAL_HOW + "".join(f"  {line}\n" for line in lines)})
    return spec, spec.read_text().splitlines().index(f"  {lines[-1]}") + 1


@pytest.mark.parametrize("field", sorted(WRITE_FIELDS))
def test_every_form_of_a_system_folder_in_a_field_that_writes_is_refused_at_its_line(field: str, tmp_path: Path):
    for value in forms(tmp_path):
        if WRITE_FIELDS[field] == "database":
            value = f"sqlite:///{value.removeprefix('file://')}/mlflow.db"
        spec, line = spec_setting(tmp_path, field, value)
        with pytest.raises(SpecError) as refused:
            load_spec(spec)
        said = [str(p) for p in refused.value.problems if f"{spec}:{line}: {field}:" in str(p)]
        assert said and ("system folder" in said[0] or "relative" in said[0]), (value, refused.value.problems)
    assert not Path(f"/etc/{TARGET}").exists()


@pytest.mark.parametrize("option", sorted(k for k, v in WRITE_OPTIONS.items() if v))
def test_every_form_of_a_system_folder_given_to_a_write_option_exits_2_writing_nothing(
        option: tuple[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    spec = write_minimal_spec(tmp_path)
    runner = CliRunner()
    for value in forms(tmp_path):
        args = [str(spec) if a == SPEC else a.replace("V", value.removeprefix("file://") if "sqlite" in a
                                                      else value) for a in WRITE_OPTIONS[option] or []]
        before = sorted(p.name for p in tmp_path.iterdir())
        result = runner.invoke(app, args)
        said = " ".join(result.output.split())
        assert result.exit_code == 2, (args, result.exit_code, said)
        assert option[1] in said and ("system folder" in said or "cannot hold a store" in said), (args, said)
        assert sorted(p.name for p in tmp_path.iterdir()) == before, args  # nothing written here
    assert not Path(f"/etc/{TARGET}").exists()
