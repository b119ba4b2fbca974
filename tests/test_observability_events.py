"""On a real Prefect server: a training step shows its progress and loss plot live in the UI (seen in headless
Chromium while the stage still trains), and each checkpoint it commits emits an event that `compass deploy`'s
automation turns into one evaluation flow run, with no schedule; the scheduled evaluation, run afterwards as the
fallback, finds nothing left to evaluate."""

from __future__ import annotations

import datetime
import json
import re
import subprocess
import time
from pathlib import Path

import pytest

from tests.conftest import (
    FIXTURES,
    REPO,
    VENV_BIN,
    Cli,
    prefect_client,
    remove_gpu_limit,
    seeded,
    stop_group,
    write_minimal_spec,
)

pytestmark = pytest.mark.slow
SCREENSHOTS = REPO / "test-artifacts"
SUITE = ("  evaluation:\n    benchmarks:\n      - {name: arc_easy, formulation: cf, limit: 10}\n"
         "    perplexity_sources: [notes]\n  pretraining:")
LONGER_STAGE = "{name: stage1, tokens: 150000,"  # 585 steps: long enough to be watched
HOW = "how:\n  checkpoints: {every_steps: 300, keep_last: 2}\n  monitoring: {progress_every_s: 1, plot_every_s: 1}\n"
DEPLOYMENT = "compass-checkpoint-evaluation/on-checkpoint-minimal"


def _artifact(api_url: str, key: str, since: datetime.datetime):
    """The latest artifact under `key` made since the test started: the server is shared with the other tests of
    this pytest worker, and an earlier test's run of the same spec writes under the same key. (Not the module's
    import time: pytest-xdist imports every module when its worker starts.)"""
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey
    from prefect.client.schemas.sorting import ArtifactSort

    with prefect_client(api_url) as client:
        found = client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[key])),
                                      sort=ArtifactSort.CREATED_DESC, limit=1)
    return found[0] if found and found[0].created and found[0].created > since else None


def _evaluation_runs(api_url: str) -> list:
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterName, FlowRunFilter

    with prefect_client(api_url) as client:
        deployment = client.read_deployment_by_name(DEPLOYMENT)
        return client.read_flow_runs(deployment_filter=DeploymentFilter(name=DeploymentFilterName(
            any_=[deployment.name])), flow_run_filter=FlowRunFilter())


def test_live_progress_and_one_evaluation_per_committed_checkpoint(server_cli: Cli, data_store: Path, tmp_path: Path):
    from selenium.webdriver.common.by import By

    from tests.browser import chromium, wait_for_text

    started = datetime.datetime.now(datetime.UTC)
    store = seeded(tmp_path / "store", data_store)  # the data steps committed: the run is the stage that is watched
    spec = write_minimal_spec(tmp_path, **{"  pretraining:": SUITE, "{name: stage1, tokens: 20000,": LONGER_STAGE,
                                           "how:\n": HOW})
    api = server_cli.env["PREFECT_API_URL"]
    deployed = server_cli.json("deploy", str(spec), "--pool", "events")  # the store: how.storage.root, here
    assert DEPLOYMENT in {d["name"] for d in deployed["deployments"]}
    worker = subprocess.Popen([str(VENV_BIN / "compass"), "worker", "--pool", "events", "--store", str(store),
                               "--specs", str(tmp_path)], cwd=tmp_path,  # its own roots, and the fixtures':
                              env=server_cli.env | {"COMPASS_ALLOWED_ROOTS": str(FIXTURES)},
                              start_new_session=True, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    run = subprocess.Popen([str(VENV_BIN / "compass"), "run", str(spec), "--until", "pretrain:stage1",
                            "--store", str(store)], cwd=tmp_path, env=server_cli.env, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        # the live artifact, in the UI, while the stage still trains
        deadline = time.monotonic() + 600
        while (live := _artifact(api, "minimal-pretrain-stage1-live", started)) is None \
                or int(re.search(r"step (\d+) of", live.data).group(1)) < 100:  # a curve, not its first point
            assert run.poll() is None, run.stdout.read()[-3000:]
            assert time.monotonic() < deadline, "no live artifact"
            time.sleep(0.5)
        SCREENSHOTS.mkdir(exist_ok=True)
        with chromium(tmp_path) as browser:
            browser.get(f"{api.removesuffix('/api')}/artifacts/artifact/{live.id}")
            wait_for_text(browser, "training, live")
            text = browser.find_element(By.TAG_NAME, "body").text
            done, total = map(int, re.search(r"step (\d+) of (\d+)", text).groups())
            assert 0 < done < total == 585, text  # shown before the stage's end
            deadline = time.monotonic() + 30
            while not [browser.execute_script("return arguments[0].naturalWidth", img)
                       for img in browser.find_elements(By.CSS_SELECTOR, "img[alt='loss']")
                       if browser.execute_script("return arguments[0].naturalWidth", img) > 100]:
                assert time.monotonic() < deadline, "the live loss plot never decoded"
                time.sleep(0.5)
            browser.save_screenshot(str(SCREENSHOTS / "live-training.png"))
        # (the version shown was published mid-stage: step done < total; the run itself may have finished since)
        progress = _artifact(api, "minimal-pretrain-stage1-progress", started)
        assert progress is not None and progress.type == "progress"
        assert run.wait(timeout=900) == 0, run.stdout.read()[-3000:]
        assert float(_artifact(api, "minimal-pretrain-stage1-progress", started).data) == 100.0

        # two checkpoints committed (steps 300 and 585): two evaluation runs, started by their events
        manifest = json.loads(next(store.glob("pretrain/stage1-*/manifest.json")).read_text())
        weights = {e["path"].split("/")[1]: e["sha256"] for e in manifest["files"]
                   if e["path"].startswith("checkpoints/") and e["path"].endswith("model.safetensors")}
        assert sorted(weights) == ["step-00000300", "step-00000585"]
        deadline = time.monotonic() + 600
        while len([r for r in _evaluation_runs(api) if r.state and r.state.is_final()]) < 2:
            assert time.monotonic() < deadline, [(r.name, r.state_name) for r in _evaluation_runs(api)]
            assert worker.poll() is None, "the worker exited"
            time.sleep(2)
        time.sleep(5)  # nothing more comes
        runs = _evaluation_runs(api)
        assert len(runs) == 2 and all(r.state.is_completed() for r in runs), [(r.name, r.state_name) for r in runs]
        evaluated = {r.parameters["checkpoint"]["folder"]: r.parameters["checkpoint"]["weights_sha256"] for r in runs}
        assert evaluated == weights
        results = sorted(store.glob(".evaluations/*/*.json"))
        assert len(results) == 2
        assert {json.loads(p.read_text())["checkpoint"]["weights_sha256"] for p in results} == set(weights.values())

        # the schedule stays as the fallback: it finds every checkpoint evaluated (the final is step 585's weights)
        scan = json.loads(server_cli("evaluate-schedule", str(spec), "--root", str(store), "--once",
                                     "--json").stdout)
        assert scan["checkpoints"] == 2 and scan["evaluated"] == []
    finally:
        if run.poll() is None:
            stop_group(run)
        stop_group(worker)
        remove_gpu_limit(api)
