"""The production path on one machine, with the demo spec: a Prefect server, `compass deploy`, a process worker,
`compass submit --smoke --watch` of the demo spec (every phase, at smoke size: the full-size demo is `make demo`)
with its store on a real S3-compatible server, then the run seen
through `compass status`, `compass run` (a fully cached re-run on S3), `prefect deployment run`, and the web UI
in headless Chromium. The demo runs once here; every phase of the lifecycle is checked on what it left in S3."""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from compass.flows.lifecycle import artifact_key
from compass.infra.net import free_port
from tests.conftest import REPO, VENV_BIN, Cli, base_env, prefect_client, remove_gpu_limit, stop_group
from tests.s3_server import KEY_ID, SECRET, RestartableS3

pytestmark = pytest.mark.slow
DEMO = REPO / "specs" / "examples" / "tiny.yaml"
BUCKET = "compass-demo"
SUBMITTED = f"s3://{BUCKET}/tiny"  # --store given to submit; --smoke writes beside it:
ROOT = f"{SUBMITTED}-smoke"
NAME = "tiny-demo-smoke"
SCREENSHOTS = REPO / "test-artifacts"


@dataclass
class Production:
    cli: Cli
    s3: RestartableS3
    submitted: dict
    api_url: str

    def fs(self):
        import s3fs

        return s3fs.S3FileSystem(key=KEY_ID, secret=SECRET, client_kwargs={"endpoint_url": self.s3.url})

    def one(self, pattern: str) -> dict:
        """The JSON file matching `pattern` under the demo's store (exactly one)."""
        fs = self.fs()
        (path,) = fs.glob(f"{BUCKET}/tiny-smoke/{pattern}")
        return json.loads(fs.cat(path))


@pytest.fixture(scope="module")
def production(prefect_server: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Production]:
    home = tmp_path_factory.mktemp("production")
    s3 = RestartableS3(free_port())
    s3.start()
    s3.create_bucket(BUCKET)
    env = base_env(home / "prefect-client") | s3.env | {"PREFECT_API_URL": prefect_server}
    cli = Cli(home, env)
    deployed = cli.json("deploy", str(DEMO))
    assert {d["name"] for d in deployed["deployments"]} == {  # the smoke run's events are not tiny-demo's
        "compass-lifecycle/lifecycle", "compass-lifecycle/ablations",
        "compass-checkpoint-evaluation/on-checkpoint-tiny-demo"}
    log = open(home / "worker.log", "w")  # noqa: SIM115 (closed in finally)
    worker = subprocess.Popen([str(VENV_BIN / "compass"), "worker"], cwd=home, env=env, stdout=log,
                              stderr=subprocess.STDOUT, start_new_session=True)
    try:
        done = cli("submit", str(DEMO), "--store", SUBMITTED, "--smoke", "--watch", "--json", timeout=2400)
        submitted = json.loads(done.stdout)
        yield Production(cli, s3, submitted, prefect_server)
    finally:
        stop_group(worker)
        log.close()
        remove_gpu_limit(prefect_server)
        s3.stop()


def test_submitted_demo_runs_every_phase_with_its_store_on_s3(production: Production):
    assert production.submitted["state"] == "Completed"
    assert production.submitted["url"].endswith(f"/runs/flow-run/{production.submitted['id']}")
    p = production
    fs = p.fs()
    sources = {"docs_en", "docs_fr", "docs_de", "docs_es", "books_en", "code_py"}
    models = ["pretrain:stage1", "pretrain:stage2", "long_context:ctx512", "long_context:ctx1024", "post_train:sft",
              "post_train:apo", "post_train:grpo"]
    ablations = {f"ablate:{v}-s{s}" for v in ("baseline", "untied") for s in (0, 1)} | {"compare:ablations"}
    committed = {"{kind}:{name}".format(**json.loads(fs.cat(m)))
                 for m in fs.glob(f"{BUCKET}/tiny-smoke/*/*/manifest.json")}
    assert committed == ({f"{k}:{s}" for s in sources for k in ("ingest", "curate", "tokenize")}
                         | {"tokenizer:select", "curves:evaluation", "report:success"} | set(models)
                         | {f"evaluate:{m.replace(':', '-')}" for m in models} | ablations)

    comparison = p.one("compare/ablations-*/comparison.json")
    (untied,) = [r for r in comparison["rows"] if r["variant"] == "untied"]
    assert untied["runs"] == 2 and untied["verdict"] in ("better", "worse", "within noise")
    evaluation = p.one("evaluate/pretrain-stage2-*/results.json")
    assert 0 <= evaluation["arc_easy:cf/acc"] <= 1 and 0 <= evaluation["hellaswag:cf/acc"] <= 1
    assert 0 <= evaluation["arithmetic:gen/verified_acc"] <= 1  # the generative path, in the demo
    assert evaluation["val_ppl:docs_en"] > 1
    for stage in ("stage1", "stage2"):
        metrics = p.one(f"pretrain/{stage}-*/manifest.json")["metrics"]
        assert metrics["final_loss"] < metrics["first_loss"]
        assert set(metrics["val_loss"]) >= {"docs_en", "code_py"}
    for model in ("pretrain:stage2", "long_context:ctx1024"):
        results = p.one(f"evaluate/{model.replace(':', '-')}-*/results.json")
        assert {f"passkey@{n}" for n in (256, 512, 1024)} <= set(results)
    config = p.one("long_context/ctx1024-*/final/config.json")
    assert config["rope_parameters"]["rope_type"] == "yarn" and config["rope_parameters"]["rope_theta"] == 100000
    curves = p.one("curves/evaluation-*/curves.json")
    assert set(curves["val_ppl:docs_en"]) == set(models)
    assert curves["val_ppl:docs_en"]["pretrain:stage1"]  # every kept checkpoint: tests/test_evaluate.py
    report = p.one("report/success-*/report.json")
    assert report["criteria"][0]["checkpoint"] == "post_train:grpo" and report["criteria"][0]["measured"] > 1
    vibes = p.one("post_train/sft-*/vibe_check.json")  # the demo's SFT is a hybrid reasoner: both modes
    assert sorted((v["mode"], v["prompt"]) for v in vibes) == sorted(
        (mode, v["prompt"]) for mode in ("/think", "/no_think") for v in vibes[:3])

    tokenizers = p.one("tokenizer/select-*/comparison.json")
    assert set(tokenizers["results"][0]["groups"]) == {"en", "fr", "de", "es", "code"}
    fertility = {r["candidate"]: r["mean_fertility"] for r in tokenizers["results"]}
    assert fertility["bpe-2048"] > fertility["bpe-4096"] > fertility["bpe-8192"]  # bigger vocab, fewer tokens
    ingest = p.one("ingest/docs_fr-*/manifest.json")
    assert ingest["provenance"][0]["package"] == "debian-reference-fr"

    for path in fs.glob(f"{BUCKET}/tiny-smoke/*/*/manifest.json"):  # credentials reach neither manifests nor files
        assert SECRET not in fs.cat(path).decode()


def test_tokenizer_from_s3_round_trips_text(production: Production, tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch):
    import s3fs
    from transformers import AutoTokenizer

    from compass.infra.store import Store

    for key, value in production.s3.env.items():
        monkeypatch.setenv(key, value)
    s3fs.S3FileSystem.clear_instance_cache()  # instances remember the endpoint of an earlier test's server
    store = Store(ROOT)
    (manifest,) = store.committed("tokenizer", "select")
    local = store.local_path(manifest.uri, cache_dir=tmp_path, only="chosen") / "chosen"
    assert not (local.parent / "comparison.json").exists()  # only the sub-folder asked for came down
    tok = AutoTokenizer.from_pretrained(str(local))
    text = "Le paquet est installé avec apt-get."
    assert tok.decode(tok(text)["input_ids"]) == text


def test_status_shows_the_run_its_last_step_and_store(production: Production):
    rows = json.loads(production.cli("status", "--json").stdout)
    (row,) = [r for r in rows if r["id"] == production.submitted["id"]]
    assert row["state"] == "Completed" and row["store"] == ROOT and row["deployment"] == "lifecycle"
    assert row["current_step"] == "report:success" or row["current_step"].startswith(("curves:", "evaluate:"))
    assert row["steps_done"] >= 40


def test_rerun_on_s3_is_fully_cached_and_logs_hold_no_secret(production: Production):
    again = production.cli.json("run", str(DEMO), "--store", SUBMITTED, "--smoke")
    assert again["steps"] and not [s for s in again["steps"] if s["executed"]]
    assert all(s["uri"].startswith(ROOT + "/") for s in again["steps"])
    tokenizer_uri = next(s["uri"] for s in again["steps"] if s["step"] == "tokenizer:select")
    tree = production.cli.json("lineage", f"{tokenizer_uri}/chosen/tokenizer.json")  # read from s3:// manifests
    assert {c["step"] for c in tree["inputs"]} == {f"curate:{s}" for s in
                                                   ("docs_en", "docs_fr", "docs_de", "docs_es", "books_en", "code_py")}

    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

    with prefect_client(production.api_url) as client:
        logs = client.read_logs(LogFilter(flow_run_id=LogFilterFlowRunId(any_=[production.submitted["id"]])),
                                limit=200)
    assert logs and not [log for log in logs if SECRET in log.message]


def test_prefect_deployment_run_takes_the_same_parameters(production: Production):
    """The documented alternative to `compass submit`: the Prefect CLI with a JSON parameter object."""
    params = {"spec_yaml": DEMO.read_text(), "spec_path": str(DEMO), "base_dir": str(DEMO.parent),
              "store_root": ROOT, "until": ["ingest", "curate", "tokenizer", "tokenize"], "smoke": True}
    done = subprocess.run([str(VENV_BIN / "prefect"), "deployment", "run", "compass-lifecycle/lifecycle",
                           "--params", json.dumps(params), "--watch"], cwd=production.cli.cwd,
                          env=production.cli.env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "Completed" in done.stdout + done.stderr


def test_a_run_refuses_a_spec_text_that_does_not_match_its_hash(production: Production):
    params = {"spec_yaml": DEMO.read_text().replace("tiny-demo", "tampered"), "spec_path": str(DEMO),
              "base_dir": str(DEMO.parent), "store_root": ROOT, "spec_hash": "0" * 64}
    done = subprocess.run([str(VENV_BIN / "prefect"), "deployment", "run", "compass-lifecycle/lifecycle",
                           "--params", json.dumps(params), "--watch"], cwd=production.cli.cwd,
                          env=production.cli.env, capture_output=True, text=True, timeout=600)
    assert done.returncode != 0
    rows = json.loads(production.cli("status", "--json").stdout)
    assert rows[0]["state"] == "Failed" and rows[0]["steps_done"] == 0


def test_web_ui_shows_the_run_its_task_runs_and_artifacts(production: Production, tmp_path: Path):
    """The Prefect UI in headless Chromium: the run, every step as a task run, every step's artifact, and a
    plot that the page decoded as an image. Screenshots go to test-artifacts/."""
    from selenium.webdriver.common.by import By

    from tests.browser import chromium, open_tab, text_while_scrolling, wait_for_text

    SCREENSHOTS.mkdir(exist_ok=True)
    ui = production.api_url.removesuffix("/api")
    run_id = production.submitted["id"]
    steps = {"{kind}:{name}".format(**json.loads(production.fs().cat(m)))
             for m in production.fs().glob(f"{BUCKET}/tiny-smoke/*/*/manifest.json")}
    with chromium(tmp_path) as browser:
        browser.get(f"{ui}/runs/flow-run/{run_id}")
        wait_for_text(browser, "Completed")
        wait_for_text(browser, f"{len(steps)} Task runs")
        page = browser.find_element(By.TAG_NAME, "body").text
        assert production.submitted["name"] in page and "compass-lifecycle" in page and "lifecycle" in page
        browser.save_screenshot(str(SCREENSHOTS / "flow-run.png"))

        open_tab(browser, "Task Runs")
        wait_for_text(browser, "report:success")
        shown = {line.strip() for line in text_while_scrolling(browser).splitlines()}
        assert steps <= shown, sorted(steps - shown)
        browser.save_screenshot(str(SCREENSHOTS / "task-runs.png"))

        open_tab(browser, "Artifacts")
        wait_for_text(browser, f"{NAME}-plan")
        shown = set(text_while_scrolling(browser).split())
        keys = {artifact_key(NAME, *step.split(":")) for step in steps} | {f"{NAME}-plan"}
        assert keys <= shown, sorted(keys - shown)
        browser.save_screenshot(str(SCREENSHOTS / "artifacts.png"))

        artifact = _latest_artifact(production.api_url, f"{NAME}-curves-evaluation")
        browser.get(f"{ui}/artifacts/artifact/{artifact}")
        wait_for_text(browser, "curves.png")
        deadline = time.monotonic() + 30
        while not (sizes := [browser.execute_script("return arguments[0].naturalWidth", img)
                             for img in browser.find_elements(By.CSS_SELECTOR, "img[alt='curves.png']")]) \
                or not sizes[0]:
            assert time.monotonic() < deadline, "the curves image never decoded"
            time.sleep(0.5)
        assert sizes[0] > 100  # the plot is an image the page decoded, not a broken link
        browser.save_screenshot(str(SCREENSHOTS / "curves-artifact.png"))


def _latest_artifact(api_url: str, key: str) -> str:
    """The newest markdown artifact with this key (a cached re-run publishes a newer version)."""
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey, ArtifactFilterType
    from prefect.client.schemas.sorting import ArtifactSort

    with prefect_client(api_url) as client:
        (artifact, *_) = client.read_artifacts(
            artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[key]),
                                           type=ArtifactFilterType(any_=["markdown"])),
            sort=ArtifactSort.CREATED_DESC, limit=1)
        return str(artifact.id)
