"""The demo spec on real offline data (Debian docs in four languages, Shakespeare, the Python stdlib),
in Prefect's embedded mode exactly as the README's demo command runs it; the second run is fully cached."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import REPO, Cli, base_env

pytestmark = pytest.mark.slow


def test_demo_runs_real_multilingual_data_then_caches(tmp_path: Path):
    env = base_env(tmp_path / "prefect-home")  # no PREFECT_API_URL: embedded server
    cli = Cli(tmp_path, env)
    spec = str(REPO / "specs" / "examples" / "tiny.yaml")
    store = tmp_path / "store"

    first = cli.json("run", spec, "--store", str(store))
    ran = {s["step"] for s in first["steps"] if s["executed"]}
    sources = {"docs_en", "docs_fr", "docs_de", "docs_es", "books_en", "code_py"}
    ablations = {f"ablate:{v}-s{s}" for v in ("baseline", "untied") for s in (0, 1)} | {"compare:ablations"}
    models = ["pretrain:stage1", "pretrain:stage2", "long_context:ctx512", "long_context:ctx1024", "post_train:sft",
              "post_train:apo", "post_train:grpo"]
    assert not first["not_executable"]  # every phase of the lifecycle runs
    assert ran == ({f"{k}:{s}" for s in sources for k in ("ingest", "curate", "tokenize")}
                   | {"tokenizer:select", "curves:evaluation", "report:success"} | set(models)
                   | {f"evaluate:{m.replace(':', '-')}" for m in models} | ablations)
    comparison = json.loads(next(store.glob("compare/ablations-*/comparison.json")).read_text())
    (untied,) = [r for r in comparison["rows"] if r["variant"] == "untied"]
    assert untied["runs"] == 2 and untied["verdict"] in ("better", "worse", "within noise")
    evaluation = json.loads(next(store.glob("evaluate/pretrain-stage2-*/results.json")).read_text())
    assert 0 <= evaluation["arc_easy:cf/acc"] <= 1 and 0 <= evaluation["hellaswag:cf/acc"] <= 1
    assert evaluation["val_ppl:docs_en"] > 1
    for stage in ("stage1", "stage2"):
        metrics = json.loads(next(store.glob(f"pretrain/{stage}-*/manifest.json")).read_text())["metrics"]
        assert metrics["final_loss"] < metrics["first_loss"]
        assert set(metrics["val_loss"]) >= {"docs_en", "code_py"}

    retrieval = {m: json.loads(next(store.glob(f"evaluate/{m.replace(':', '-')}-*/results.json")).read_text())
                 for m in ("pretrain:stage2", "long_context:ctx1024")}
    for results in retrieval.values():
        assert {f"passkey@{n}" for n in (256, 512, 1024)} <= set(results)
    config = json.loads(next(store.glob("long_context/ctx1024-*/final/config.json")).read_text())
    assert config["rope_parameters"]["rope_type"] == "yarn" and config["rope_parameters"]["rope_theta"] == 100000
    curves = json.loads(next(store.glob("curves/evaluation-*/curves.json")).read_text())
    assert set(curves["val_ppl:docs_en"]) == set(models)
    assert len(curves["val_ppl:docs_en"]["pretrain:stage1"]) >= 2  # every kept checkpoint, not only the last
    report = json.loads(next(store.glob("report/success-*/report.json")).read_text())
    assert report["criteria"][0]["checkpoint"] == "post_train:grpo" and report["criteria"][0]["measured"] > 1
    vibe = json.loads(next(store.glob("post_train/sft-*/vibe_check.json")).read_text())
    assert len(vibe) == 3

    comparison = json.loads(next(store.glob("tokenizer/select-*/comparison.json")).read_text())
    groups = set(comparison["results"][0]["groups"])
    assert groups == {"en", "fr", "de", "es", "code"}
    fertility = {r["candidate"]: r["mean_fertility"] for r in comparison["results"]}
    assert fertility["bpe-2048"] > fertility["bpe-4096"] > fertility["bpe-8192"]  # bigger vocab, fewer tokens
    chosen = next(store.glob("tokenizer/select-*/chosen"))
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(chosen))
    text = "Le paquet est installé avec apt-get."
    assert tok.decode(tok(text)["input_ids"]) == text

    ingest = json.loads(next(store.glob("ingest/docs_fr-*/manifest.json")).read_text())
    assert ingest["provenance"][0]["package"] == "debian-reference-fr"
    assert len(ingest["provenance"][0]["archive_sha256"]) == 64

    second = cli.json("run", spec, "--store", str(store))
    assert not [s for s in second["steps"] if s["executed"]]
    assert len(second["steps"]) == len(first["steps"])
