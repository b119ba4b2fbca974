"""The plan says what each stage draws from each source: tokens by the mixture's weights, epochs of the source per
stage and over the run, flagged past the source's `max_epochs`; sizes come from the store (the tokenized split once
tokenized, an estimate from ingest before that, unknown before anything ran)."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest

from compass.flows.reports.mixture import CHARS_PER_TOKEN, SourceSize, consumption_section
from tests.conftest import REPO, write_minimal_spec


def _minimal(tmp_path: Path, **replacements: str):
    from compass.specs import load_spec

    return load_spec(write_minimal_spec(tmp_path, **replacements)).spec


def test_epochs_add_up_over_the_stages_and_a_source_read_past_its_limit_is_flagged(tmp_path: Path):
    # stage1 draws 20k tokens as notes 0.7 / code 0.3, stage2 10k as 0.5 / 0.5
    spec = _minimal(tmp_path, **{"      - name: notes\n": "      - name: notes\n        max_epochs: 3\n"})
    sizes = {"notes": SourceSize(5000, "tokenized"), "code": SourceSize(100_000, "tokenized")}
    section = consumption_section(spec, sizes)
    rows = {(r[0], r[1]): r for r in section.rows}
    assert rows[("pretraining stage1", "notes")][3:8] == ["14.00k", "5.00k", "tokenized", "2.80", "2.80"]
    assert rows[("pretraining stage2", "notes")][6:8] == ["1.00", "3.80 > max"]  # 14k + 5k of 5k, limit 3
    assert rows[("pretraining stage2", "code")][6:8] == ["0.05", "0.11"]
    assert len(section.notes) == 1 and section.notes[0].startswith("notes is read 3.8 times over the run")
    assert consumption_section(spec, {**sizes, "notes": SourceSize(50_000, "tokenized")}).notes == []

    unknown = consumption_section(spec, {"notes": SourceSize(None, "unknown"), "code": SourceSize(None, "unknown")})
    assert all(r[6] == "?" for r in unknown.rows) and "not ingested yet" in unknown.notes[-1]


def test_max_epochs_must_be_positive(tmp_path: Path):
    from compass.specs.loader import SpecError, load_spec

    spec = write_minimal_spec(tmp_path, **{"      - name: notes\n": "      - name: notes\n        max_epochs: 0\n"})
    with pytest.raises(SpecError, match="max_epochs"):
        load_spec(spec)


def _plan_sizes(spec: Path, store: Path) -> dict[str, tuple[str, str]]:
    done = subprocess.run([sys.executable, "-m", "compass.flows.cli.app", "plan", str(spec), "--store", str(store),
                           "--json"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    section = next(s for s in json.loads(done.stdout)["sections"] if s["title"] == "Data consumption by stage")
    return {r[1]: (r[4], r[5]) for r in section["rows"] if r[0] == "pretraining stage1"}


@pytest.mark.slow  # the data steps end to end
def test_compass_plan_reads_source_sizes_from_the_store_as_the_data_steps_commit(tmp_path: Path):
    from compass.flows.compiler import compile_spec
    from compass.flows.reports.plan_tables import human
    from compass.flows.runner import run_in_process
    from compass.infra.store import Store
    from compass.specs import load_spec
    from compass.tasks.steps.context import Runtime

    spec = write_minimal_spec(tmp_path)
    store = tmp_path / "store"
    assert _plan_sizes(spec, store) == {"notes": ("?", "unknown"), "code": ("?", "unknown")}
    loaded = load_spec(spec)
    plan = compile_spec(loaded.spec)
    runtime = Runtime(how=loaded.spec.how, base_dir=loaded.base_dir)
    run_in_process(plan.restricted_to({"ingest"}), Store(str(store)), loaded.spec_hash, runtime,
                   logging.getLogger("test"))
    ingested = Store(str(store)).read_manifest(Store(str(store)).uri("ingest", "notes",
                                                                     plan.fingerprints["ingest:notes"]))
    sizes = _plan_sizes(spec, store)
    assert sizes["notes"] == (human(ingested.metrics["characters"] / CHARS_PER_TOKEN), "estimated from ingest")
    run_in_process(plan.restricted_to({"ingest", "curate", "tokenizer", "tokenize"}), Store(str(store)),
                   loaded.spec_hash, runtime, logging.getLogger("test"))
    tokenized = Store(str(store)).read_manifest(Store(str(store)).uri("tokenize", "notes",
                                                                      plan.fingerprints["tokenize:notes"]))
    assert _plan_sizes(spec, store)["notes"] == (human(tokenized.metrics["train_tokens"]), "tokenized")
