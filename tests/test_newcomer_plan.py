"""The plan speaks the machine's language (issue 45, item 11): a CPU spec is planned in ranks and rank-hours, not
GPUs; the memory table names the engine's own ways to shard (DeepSpeed's ZeRO stages, or DDP against FSDP2)."""

from __future__ import annotations

from pathlib import Path

import pytest

from compass.flows.reports.plan_tables import cost_sections
from compass.specs import load_spec
from tests.conftest import write_minimal_spec


def sections_of(spec: Path) -> dict:
    return {s.title: s for s in cost_sections(load_spec(spec).spec)}


def test_a_cpu_spec_is_planned_in_ranks_and_its_engines_sharding(tmp_path: Path):
    deepspeed = sections_of(write_minimal_spec(tmp_path))
    assert deepspeed["Training compute"].columns[4:6] == ["rank-hours", "ranks"]
    assert "GPU" not in " ".join(deepspeed["Training compute"].notes)
    memory = deepspeed["Memory per rank"]
    assert [r[0] for r in memory.rows] == ["ZeRO-0 (spec)", "ZeRO-1", "ZeRO-2", "ZeRO-3"]

    engine = "{micro_batch_size: 2}"
    ddp = sections_of(write_minimal_spec(tmp_path, **{engine: "{micro_batch_size: 2, deepspeed: false}"}))
    assert [r[0] for r in ddp["Memory per rank"].rows] == ["DDP (no sharding) (spec)", "FSDP2 (fully sharded)"]
    fsdp2 = sections_of(write_minimal_spec(tmp_path, **{engine: "{micro_batch_size: 2, engine: fsdp2}"}))
    assert [r[0] for r in fsdp2["Memory per rank"].rows] == ["DDP (no sharding)", "FSDP2 (fully sharded) (spec)"]

    gpu = sections_of(write_minimal_spec(tmp_path, **{"how:\n": "how:\n  hardware: {accelerator: h100}\n"}))
    assert gpu["Training compute"].columns[4:6] == ["GPU-hours", "GPUs"] and "Memory per GPU" in gpu


def test_a_plan_creates_nothing_and_says_which_store_it_plans_against(tmp_path: Path):
    import json

    from typer.testing import CliRunner

    from compass.flows.cli.app import app

    store = tmp_path / "not-yet"
    done = CliRunner().invoke(app, ["plan", str(write_minimal_spec(tmp_path)), "--store", str(store), "--json"])
    assert done.exit_code == 0, done.output
    (dag,) = [s for s in json.loads(done.stdout)["sections"] if s["title"] == "DAG"]
    assert dag["notes"][0].endswith(f"outputs under {store} (a new store: the first run creates it)")
    assert not store.exists()  # planning wrote nothing


def test_every_command_finds_the_spec_s_store_from_any_working_directory(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch):
    """One base for relative paths (issue 45, item 5): `how.storage.root: store` is the folder beside the spec, as its
    sources are, wherever `compass` runs from; `--store` on the command line starts at the working directory."""
    import json

    from typer.testing import CliRunner

    from compass.flows.cli.app import app

    specs, elsewhere = tmp_path / "project" / "specs", tmp_path / "elsewhere"
    specs.mkdir(parents=True)
    elsewhere.mkdir()
    spec = write_minimal_spec(specs, **{"how:\n": "how:\n  storage: {root: store}\n"})
    monkeypatch.chdir(elsewhere)

    def outputs(*extra: str) -> str:
        done = CliRunner().invoke(app, ["plan", str(spec), "--json", *extra])
        assert done.exit_code == 0, done.output
        (dag,) = [s for s in json.loads(done.stdout)["sections"] if s["title"] == "DAG"]
        return dag["notes"][0]

    assert f"outputs under {specs / 'store'} (a new store" in outputs()
    assert f"outputs under {elsewhere / 'mine'} (a new store" in outputs("--store", "mine")
    assert list(elsewhere.iterdir()) == [] and not (specs / "store").exists()  # planning created nothing
