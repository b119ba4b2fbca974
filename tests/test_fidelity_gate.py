"""The gate, measured: an existing model (built here, placed in a Hugging Face cache as `hf download` leaves it) is
evaluated on the spec's benchmark before any training. Meeting every criterion stops the run with a report
(exit 3, nothing trained); falling short lets training start; `why.override` lets it go on with its reason kept."""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
from pathlib import Path

import pytest

from tests.conftest import VENV_BIN, base_env, seeded, write_minimal_spec
from tests.hub_cache import COMMIT, seed_model, tiny_llama

pytestmark = pytest.mark.slow
REPO_ID = "acme/tiny-chat"
ITEMS = 32
BELOW = 1 / 64  # met only when every likely resample of the 32 items holds a right answer: above none, by the interval
SUITE = f"  evaluation:\n    benchmarks:\n      - {{name: arc_easy, formulation: cf, limit: {ITEMS}}}\n  pretraining:"


def production_why(threshold: float, override: str | None = None) -> str:
    return ("why:\n  reason: production\n  need: a support assistant that runs on one CPU core\n"
            f"  existing_models:\n    - {{model: {REPO_ID}}}\n"
            + (f"  override: {override}\n" if override else "")
            + f'  success_criteria:\n    - {{metric: "arc_easy:cf/acc", op: ">=", threshold: {threshold}}}\nwhat:\n')


def spec_with(folder: Path, threshold: float, override: str | None = None) -> Path:
    path = write_minimal_spec(folder, **{"  pretraining:": SUITE})
    path.write_text(re.sub(r"^why:\n.*?^what:\n", production_why(threshold, override), path.read_text(),
                           flags=re.S | re.M))
    return path


@pytest.fixture(scope="module")
def hub_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small Llama with its own BPE tokenizer, as the snapshot of acme/tiny-chat in a hub cache."""
    root = tmp_path_factory.mktemp("hub")
    seed_model(root / "cache", REPO_ID, tiny_llama(root / "files"))
    return root / "cache"


def test_an_existing_model_that_meets_the_criteria_stops_the_run(hub_cache: Path, data_store: Path, prefect_server: str,
                                                                  tmp_path: Path):
    spec = spec_with(tmp_path, threshold=BELOW)
    seeded(tmp_path / "store", data_store)
    env = base_env(tmp_path / "prefect") | {"HF_HUB_CACHE": str(hub_cache), "PREFECT_API_URL": prefect_server}
    done = subprocess.run([str(VENV_BIN / "compass"), "run", str(spec), "--until", "pretrain:stage1", "--store",
                           str(tmp_path / "store")], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 3, done.stderr[-3000:]
    assert "training is not justified" in done.stderr and REPO_ID in done.stderr and "why.override" in done.stderr
    assert not list((tmp_path / "store").glob("pretrain/*/manifest.json"))  # nothing trained
    (gate,) = (tmp_path / "store").glob("gate/*/gate.json")
    report = json.loads(gate.read_text())
    assert report["verdict"] == "not justified" and report["revision"] == COMMIT
    assert report["source"] == f"hf://{REPO_ID}" and len(report["weights_sha256"]) == 64
    (criterion,) = report["criteria"]  # met by the interval over the items, not the point estimate alone
    assert criterion["met"] and criterion["verdict"] == "met" and criterion["items"] == ITEMS
    low, high = criterion["interval"]
    assert BELOW <= low <= report["scores"]["arc_easy:cf/acc"] <= high  # a gate scoring 0 fails


def test_falling_short_trains_and_an_override_goes_on_with_its_reason(hub_cache: Path, data_store: Path,
                                                                        tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch):
    from compass.flows.compiler import compile_spec
    from compass.flows.runner import run_in_process
    from compass.infra.store import Store
    from compass.specs import load_spec
    from compass.tasks.steps.context import Runtime

    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(hub_cache))
    monkeypatch.setitem(os.environ, "HF_HUB_OFFLINE", "1")
    store = Store(str(seeded(tmp_path / "store", data_store)))
    reason = "we need a model whose training data we can audit end to end"
    measured: list[float] = []  # the override's run measures the score; the next threshold sits just above it
    for folder, threshold, override, verdict in ((tmp_path / "over", 0.0, reason, "overridden"),
                                                  (tmp_path / "short", None, None, "justified")):
        threshold = threshold if threshold is not None else measured[0] + 1 / (2 * ITEMS)  # just above it
        folder.mkdir()
        loaded = load_spec(spec_with(folder, threshold, override))
        plan = compile_spec(loaded.spec)
        assert plan.step("pretrain:stage1").inputs["gate:acme-tiny-chat"] == "gate:acme-tiny-chat"
        assert plan.step("report:success").config.override == override
        outcomes = run_in_process(plan.up_to(["pretrain:stage1"]), store, loaded.spec_hash,
                                  Runtime(how=loaded.spec.how, base_dir=loaded.base_dir), logging.getLogger("test"))
        gate = outcomes["gate:acme-tiny-chat"].manifest.metrics
        assert gate["verdict"] == verdict, (threshold, gate)
        measured.append(gate["scores"]["arc_easy:cf/acc"])
        assert outcomes["pretrain:stage1"].manifest.kind == "pretrain"  # training went on past the gate
