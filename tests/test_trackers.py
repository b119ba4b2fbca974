"""Experiment trackers (how.monitoring.trackers): a step's run in a real MLflow server on loopback, in W&B's offline
run files and in trackio's local database, read back through each one's own reader; a retried step continues its
run, a tracker that is down never fails a step, and the spec refuses a tracker it cannot reach. Every training
step of the lifecycle reporting to all three is tested end to end in test_post_training.py."""

from __future__ import annotations

import json
import os
import sqlite3
from collections.abc import Iterator
from pathlib import Path

import pytest

from compass.model.training.trackers import TrackerRun, Trackers, flat_params
from tests.conftest import write_minimal_spec
from tests.tracker_servers import mlflow_server, wandb_offline_history, wandb_offline_records


@pytest.fixture(scope="module")
def mlflow_uri(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with mlflow_server(tmp_path_factory.mktemp("mlflow")) as uri:
        yield uri


def a_run(folder: Path, uri: str, key: str = "pretrain/stage1-0123456789ab", **changes) -> TrackerRun:
    params = {**flat_params({"lr": 1e-3, "schedule": {"kind": "wsd", "warmup_steps": 2}}), "compass.spec_hash": "f00d"}
    fields = dict(trackers=("mlflow", "wandb", "trackio"), project="tracked", group="tracked-f00dcafe",
                  name="pretrain:stage1", kind="pretrain", key=key, params=params, folder=folder,
                  mlflow_tracking_uri=uri)
    return TrackerRun(**{**fields, **changes})


def test_flat_params_name_nested_fields():
    assert flat_params({"a": {"b": 1, "c": [1, 2]}, "d": "x", "e": {}}) == {"a.b": "1", "a.c": "[1, 2]", "d": "x",
                                                                            "e": "{}"}


@pytest.mark.slow  # an MLflow server and a training step
def test_a_step_run_in_mlflow_wandb_and_trackio(tmp_path: Path, mlflow_uri: str):
    from mlflow import MlflowClient

    run = a_run(tmp_path, mlflow_uri)
    trackers = Trackers(run)
    assert set(trackers.sinks) == {"mlflow", "wandb", "trackio"}
    for i in range(4):
        trackers.log({"train/loss": 5.0 - i, "train/mfu": None, "flag": True}, tokens=256 * (i + 1))
    trackers.close()

    client = MlflowClient(tracking_uri=mlflow_uri)
    experiment = client.get_experiment_by_name("tracked")
    (found,) = client.search_runs([experiment.experiment_id], filter_string="tags.`compass.step` = 'pretrain:stage1'")
    assert found.info.run_name == "pretrain:stage1" and found.info.status == "FINISHED"
    assert found.data.tags["compass.group"] == "tracked-f00dcafe"
    assert found.data.params["compass.spec_hash"] == "f00d" and found.data.params["schedule.kind"] == "wsd"
    history = client.get_metric_history(found.info.run_id, "train/loss")
    assert [(m.step, m.value) for m in history] == [(256, 5.0), (512, 4.0), (768, 3.0), (1024, 2.0)]
    assert set(found.data.metrics) == {"train/loss"}  # None and booleans are not metrics
    assert [a.path for a in client.list_artifacts(found.info.run_id, "compass")] == ["compass/step.json"]

    (run_file,) = (tmp_path / "wandb").glob(f"offline-run-*-{run.run_id}/run-{run.run_id}.wandb")
    records = list(wandb_offline_records(run_file))
    (started,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert (started.project, started.run_group, started.display_name, started.job_type) == (
        "tracked", "tracked-f00dcafe", "pretrain:stage1", "pretrain")
    config = {i.key: json.loads(i.value_json) for i in started.config.update}
    assert config["compass.spec_hash"] == "f00d" and config["schedule.kind"] == "wsd"
    rows = wandb_offline_history(run_file)
    assert [(r["tokens"], r["train/loss"]) for r in rows] == [(256, 5), (512, 4), (768, 3), (1024, 2)]
    assert [r.exit.exit_code for r in records if r.WhichOneof("record_type") == "exit"] == [0]

    database = Path(os.environ["TRACKIO_DIR"]) / "tracked.db"
    with sqlite3.connect(database) as db:
        points = db.execute("SELECT step, metrics FROM metrics WHERE run_name = ? ORDER BY step",
                            (f"pretrain:stage1-{run.run_id[:8]}",)).fetchall()
    assert [(step, json.loads(m)["train/loss"]) for step, m in points] == [(256, 5), (512, 4), (768, 3), (1024, 2)]


def test_a_retried_step_continues_its_mlflow_run_and_a_changed_step_starts_one(tmp_path: Path, mlflow_uri: str):
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=mlflow_uri)
    first = Trackers(a_run(tmp_path, mlflow_uri, key="pretrain/stage1-aaaaaaaaaaaa", trackers=("mlflow",),
                           project="retried"))
    first.log({"train/loss": 4.0}, tokens=100)
    first.close(failed=True)  # the attempt crashed
    experiment = client.get_experiment_by_name("retried").experiment_id
    (crashed,) = client.search_runs([experiment])
    assert crashed.info.status == "FAILED"

    retry = Trackers(a_run(tmp_path, mlflow_uri, key="pretrain/stage1-aaaaaaaaaaaa", trackers=("mlflow",),
                           project="retried"))
    retry.log({"train/loss": 3.0}, tokens=200)
    retry.close()
    (continued,) = client.search_runs([experiment])
    assert continued.info.run_id == crashed.info.run_id and continued.info.status == "FINISHED"
    assert [m.step for m in client.get_metric_history(continued.info.run_id, "train/loss")] == [100, 200]

    changed = Trackers(a_run(tmp_path, mlflow_uri, key="pretrain/stage1-bbbbbbbbbbbb", trackers=("mlflow",),
                             project="retried"))
    changed.close()
    assert len(client.search_runs([experiment])) == 2


def test_a_tracker_that_is_down_never_fails_the_step(tmp_path: Path, caplog: pytest.LogCaptureFixture):
    from compass.infra.net import free_port

    os.environ["MLFLOW_HTTP_REQUEST_MAX_RETRIES"] = "0"  # the client's default retries take minutes
    try:
        trackers = Trackers(a_run(tmp_path, f"http://127.0.0.1:{free_port()}", trackers=("mlflow",)))
    finally:
        del os.environ["MLFLOW_HTTP_REQUEST_MAX_RETRIES"]
    trackers.log({"train/loss": 1.0}, tokens=1)
    trackers.close()
    assert trackers.sinks == {}
    assert "mlflow run not opened" in caplog.text and "training goes on without it" in caplog.text


def test_the_spec_refuses_a_tracker_it_cannot_reach(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    from compass.flows.validation import load_checked
    from compass.specs.loader import SpecError

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))

    def problems(monitoring: str) -> str:
        spec = write_minimal_spec(tmp_path, **{"how:\n": f"how:\n  monitoring: {monitoring}\n"})
        with pytest.raises(SpecError) as raised:
            load_checked(spec)
        return str(raised.value)

    twice = problems("{trackers: [mlflow, tensorboard, mlflow]}")
    assert "how.monitoring.trackers" in twice and "mlflow listed twice" in twice
    assert "not an MLflow tracking URI" in problems("{trackers: [mlflow], mlflow_tracking_uri: 'mlflow.internal'}")
    nowhere = problems("{trackers: [tensorboard, mlflow]}")
    assert "how.monitoring.trackers" in nowhere and "no MLflow server is named" in nowhere
    online = problems("{trackers: [wandb], wandb_mode: online}")
    assert "how.monitoring.wandb_mode" in online and "WANDB_API_KEY" in online
    assert "how.monitoring.trackers[0]: Input should be 'tensorboard', 'mlflow', 'wandb' or 'trackio'" in problems(
        "{trackers: [neptune]}")

    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:5000")
    spec = write_minimal_spec(tmp_path, **{"how:\n": "how:\n  monitoring: {trackers: [mlflow, wandb, trackio]}\n"})
    assert load_checked(spec).spec.how.monitoring.trackers == ["mlflow", "wandb", "trackio"]
