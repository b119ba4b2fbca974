"""Observability: the alert rules under promtool, the Grafana dashboard against what the exporter really serves, a
throughput drop diagnosed from where step time went, token axes people can read, and a real Prometheus on
loopback reading every rank of a two-rank training while it runs (with TensorBoard event files afterwards)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.conftest import REPO

RULES = REPO / "infra" / "observability" / "compass-alerts.rules.yml"
RULE_TESTS = REPO / "tests" / "prometheus" / "compass-alerts.test.yml"


@pytest.fixture
def prometheus_installed() -> None:
    """Fails (never skips) where Debian's prometheus is missing, with the command that installs it."""
    absent = [name for name in ("prometheus", "promtool") if not shutil.which(name)]
    if absent:
        pytest.fail(f"{', '.join(absent)} not installed: run `bash infra/setup.sh` as root", pytrace=False)


def metric_names(expr: str) -> set[str]:
    return set(re.findall(r"\bcompass_[a-z_]+", expr))


@pytest.mark.usefixtures("prometheus_installed")
def test_alert_rules_check_and_pass_their_unit_tests(tmp_path: Path):
    check = subprocess.run(["promtool", "check", "rules", str(RULES)], capture_output=True, text=True)
    assert check.returncode == 0 and "SUCCESS: 8 rules found" in check.stdout, check.stdout + check.stderr
    tested = subprocess.run(["promtool", "test", "rules", str(RULE_TESTS)], capture_output=True, text=True)
    assert tested.returncode == 0 and "SUCCESS" in tested.stdout, tested.stdout + tested.stderr

    # the unit tests can fail: a GPU threshold moved from 85 to 95 C no longer alerts at 88 C
    moved = tmp_path / "infra" / "observability" / RULES.name
    moved.parent.mkdir(parents=True)
    moved.write_text(RULES.read_text().replace("compass_gpu_temperature_celsius > 85",
                                               "compass_gpu_temperature_celsius > 95"))
    (tmp_path / "tests" / "prometheus").mkdir(parents=True)
    shutil.copy(RULE_TESTS, tmp_path / "tests" / "prometheus" / RULE_TESTS.name)
    broken = subprocess.run(["promtool", "test", "rules", str(tmp_path / "tests" / "prometheus" / RULE_TESTS.name)],
                            capture_output=True, text=True)
    assert broken.returncode != 0 and "CompassGpuHot" in broken.stdout + broken.stderr


def test_every_rule_and_panel_names_metrics_the_exporter_declares():
    from ruamel.yaml import YAML

    from compass.infra.observability.dashboard import OUT, render
    from compass.model.training.telemetry import EXPOSED

    assert OUT.read_text() == render(), "stale: python -m compass.infra.observability.dashboard"
    rules = YAML(typ="safe").load(RULES.read_text())["groups"][0]["rules"]
    for rule in rules:
        assert metric_names(rule["expr"]) <= set(EXPOSED), rule["alert"]
    board = json.loads(OUT.read_text())
    panels = [p for p in board["panels"] if p["type"] != "row"]
    shown: set[str] = set()
    for p in panels:
        names = set().union(*(metric_names(t["expr"]) for t in p["targets"]))
        assert names and names <= set(EXPOSED), p["title"]
        shown |= names
    assert shown == set(EXPOSED), sorted(set(EXPOSED) - shown)  # every metric has a panel
    # the alert thresholds are drawn where an alert compares one metric with a number
    drawn = {next(iter(metric_names(t["expr"]))): s["value"] for p in panels for t in p["targets"]
             for s in p["fieldConfig"]["defaults"]["thresholds"]["steps"] if s["value"] is not None
             and len(metric_names(t["expr"])) == 1}
    for rule in rules:
        if m := re.fullmatch(r"(compass_[a-z_]+) > ([0-9.]+)", rule["expr"].strip()):
            assert drawn.get(m.group(1)) == float(m.group(2)), rule["alert"]


def _phases(data: float = 0.01, sync: float = 0.01, compute: float = 0.1) -> dict[str, float]:
    return {"data_wait": data, "sync": sync, "forward_backward": compute, "optimizer": 0.02, "checkpoint": 0.0}


@pytest.mark.parametrize(("grown", "cause"), [
    ({"data": 0.3}, "data loader or storage"),
    ({"sync": 0.3}, "network or a slower rank"),
    ({"compute": 0.4}, "kernels or throttling"),
])
def test_a_throughput_drop_names_the_part_of_the_step_that_grew(grown: dict[str, float], cause: str):
    from compass.model.training.monitors import TrainingMonitor
    from compass.specs.training import Monitors

    def drop(on_gpu: bool):
        monitor = TrainingMonitor(Monitors.model_validate({"throughput": {"ratio": 0.7, "window": 20,
                                                                          "action": "warn"}}), on_gpu)
        events = []
        for step in range(40):
            phases = _phases(**grown) if step >= 30 else _phases()
            speed = 1000 * 0.15 / sum(phases.values())
            events += monitor.record(step, 3.0, speed, phases)
        (event,) = [e for e in events if e.kind == "throughput"]
        return event

    event = drop(on_gpu=True)
    assert cause in event.cause and event.phase is not None
    assert event.phase.replace("_", " ") in event.detail and "grew from" in event.detail
    assert event.as_record().phase == event.phase
    if event.phase == "forward_backward":  # the remedy names what to check where the ranks compute
        assert "GPU clocks" in event.remedy
        on_cpu = drop(on_gpu=False).remedy
        assert "GPU" not in on_cpu and "OMP_NUM_THREADS" in on_cpu


def test_token_axes_read_at_a_glance(tmp_path: Path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from compass.tasks.common.plots import token_axis, use_token_axis
    from compass.tasks.kinds.curves import plot_curves

    assert [token_axis(n) for n in (0, 950, 200_000, 1_200_000, 3.4e12, 11e9)] == \
        ["0", "950", "200k", "1.2M", "3.4T", "11B"]
    fig, ax = plt.subplots()
    ax.plot([200_000, 3_400_000], [1, 2])
    use_token_axis(ax)
    fig.canvas.draw()
    labels = [t.get_text() for t in ax.get_xticklabels() if t.get_text()]
    assert labels and all(len(label) <= 5 for label in labels) and len(set(labels)) == len(labels), labels
    plt.close(fig)
    # two post-training steps evaluated at the same tokens: both visible (different markers, shifted)
    points = {"acc": {"post_train:apo": [(1_000_000, 0.5)], "post_train:grpo": [(1_000_000, 0.5)]}}
    plot_curves(points, tmp_path / "curves.png", "t")
    from compass.tasks.common.plots import PlotDescription

    (panel,) = PlotDescription.read(tmp_path / "curves.png").panels
    assert panel.title == "acc" and [(s.label, s.x, s.y) for s in panel.series] == [
        ("post_train:apo", (1_000_000.0,), (0.5,)), ("post_train:grpo", (1_000_000.0,), (0.5,))]
    assert panel.outside == []  # matplotlib sizes the axes from the data, though the lines are shifted apart


def _wait_ready(url: str, process: subprocess.Popen, why: Callable[[], str]) -> None:
    """Until Prometheus at `url` says it is ready (at most a minute, and only while its process lives)."""
    deadline = time.monotonic() + 60
    while True:
        try:
            _get(f"{url}/-/ready")
            return
        except OSError:
            assert process.poll() is None and time.monotonic() < deadline, why()
            time.sleep(0.3)


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as response:
        return response.read().decode()


@pytest.mark.slow
@pytest.mark.usefixtures("prometheus_installed")
def test_prometheus_reads_every_rank_while_a_stage_trains(stage1_job, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """Two ranks (torchrun, gloo) each serve their metrics and register them; a real Prometheus on loopback
    discovers both and answers for the step and the loss of each through its HTTP API while the stage trains.
    Then the stage is asked to stop (the scheduler's stop file, as before a Slurm time limit): afterwards the
    endpoints are gone from service discovery and TensorBoard holds every step trained, against tokens."""
    import logging

    from prometheus_client.parser import text_string_to_metric_families

    from compass.infra import prometheus
    from compass.infra.net import free_port
    from compass.model.training.job import Telemetry
    from compass.model.training.telemetry import GPU_METRICS, tensorboard_run
    from compass.specs.how import Checkpoints
    from compass.tasks.common.training import run_training

    folder = tmp_path / "monitoring"
    job = stage1_job(tmp_path / "work", data_parallel=2)
    stages = [s.model_copy(update={"tokens": 512_000}) if s.name == "stage1" else s for s in job.recipe.stages]
    job = job.model_copy(update={"recipe": job.recipe.model_copy(update={"stages": stages}),
                                 "telemetry": Telemetry(run="minimal", step="pretrain:stage1", folder=folder)})
    job = job.with_how(checkpoints=Checkpoints(every_steps=100_000, keep_last=1))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = prometheus.start(folder, port, scrape_interval_s=1)
    stop = tmp_path / "stop"  # touched once Prometheus has seen both ranks: the rest of the stage proves nothing
    monkeypatch.setenv("COMPASS_STOP_FILE", str(stop))
    outcome: dict = {}

    def train() -> None:
        try:
            outcome["result"] = run_training(job, logging.getLogger("test"))
        except BaseException as exc:
            outcome["error"] = exc

    trainer = threading.Thread(target=train)
    try:
        _wait_ready(url, server, lambda: (folder / "prometheus.log").read_text())
        trainer.start()
        exposed: set[str] = set()
        steps: dict[str, float] = {}
        losses: dict[str, float] = {}
        while trainer.is_alive() and not (len(steps) == 2 and len(losses) == 2 and exposed):
            targets = list((folder / "targets").glob("*.json"))
            if targets and not exposed:  # one rank's endpoint scraped directly
                address = json.loads(targets[0].read_text())[0]["targets"][0]
                exposed = {f.name for f in text_string_to_metric_families(_get(f"http://{address}/metrics"))}
            steps = {r["metric"]["rank"]: float(r["value"][1])
                     for r in prometheus.query(url, 'compass_train_step{run="minimal"}')}
            losses = {r["metric"]["rank"]: float(r["value"][1])
                      for r in prometheus.query(url, 'compass_train_loss{stage="stage1"}')}
            time.sleep(0.5)
        assert trainer.is_alive(), f"the stage ended before Prometheus saw both ranks: {steps} {losses} {outcome}"
        assert set(steps) == {"0", "1"} and all(v >= 1 for v in steps.values()), steps
        assert set(losses) == {"0", "1"} and all(0 < v < 20 for v in losses.values()), losses
        series = prometheus.query(url, "compass_train_phase_seconds")
        assert {r["metric"]["phase"] for r in series} >= {"data_wait", "forward_backward", "sync", "optimizer"}
        assert {r["metric"]["node"] for r in series} and all(r["metric"]["run"] == "minimal" for r in series)
        from compass.model.training.telemetry import EXPOSED

        assert set(EXPOSED) - set(GPU_METRICS) <= exposed, sorted(set(EXPOSED) - set(GPU_METRICS) - exposed)
        stop.touch()
        trainer.join(timeout=600)
    finally:
        server.terminate()
        server.wait(timeout=30)
        trainer.join(timeout=600)
    assert isinstance(outcome.get("error"), FileNotFoundError), outcome  # stopped: no result.json (Slurm requeues)
    (checkpoint,) = (tmp_path / "work" / "checkpoints").glob("step-*")  # where both ranks stopped together
    trained = int(checkpoint.name.removeprefix("step-"))
    assert not list((folder / "targets").glob("*.json"))  # each rank removed its endpoint when it ended

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tensorboard_run(folder, "pretrain:stage1")))
    events.Reload()
    losses_tb = events.Scalars("train/loss")
    per_step = stages[0].global_batch_size * stages[0].sequence_length
    assert len(losses_tb) == trained < stages[0].tokens // per_step
    assert [e.step for e in losses_tb] == [per_step * (i + 1) for i in range(len(losses_tb))]  # tokens seen
    assert {"train/lr", "train/grad_norm", "train/tokens_per_s", "time/data_wait_s"} <= set(events.Tags()["scalars"])


@pytest.mark.usefixtures("prometheus_installed")
def test_compass_monitor_serves_prometheus_over_the_runs_targets(tmp_path: Path):
    """`compass monitor SPEC` on loopback: ready, reading the spec's monitoring folder with the alert rules loaded;
    SIGTERM stops it (and Prometheus with it)."""
    import os
    import signal

    from compass.infra import prometheus
    from compass.infra.net import free_port
    from tests.conftest import VENV_BIN, base_env, write_minimal_spec

    spec = write_minimal_spec(tmp_path)
    port = free_port()
    proc = subprocess.Popen([str(VENV_BIN / "compass"), "monitor", str(spec), "--port", str(port),
                             "--scrape-interval", "1"], cwd=tmp_path, env=base_env(tmp_path / "prefect"),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_ready(url, proc, lambda: proc.stderr.read())
        rules = json.loads(_get(f"{url}/api/v1/rules"))["data"]["groups"][0]["rules"]
        assert {r["name"] for r in rules} >= {"CompassNoProgress", "CompassThroughputDrop", "CompassStraggler"}
        config = _get(f"{url}/api/v1/status/config")
        assert str(tmp_path / "store" / "monitoring" / "minimal" / "targets") in config
        assert prometheus.query(url, "up") == []  # no rank trains: nothing to scrape yet
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0 and f"http://127.0.0.1:{port}" in out


def test_a_trl_step_serves_the_trainers_gauges_and_its_goodput_while_it_trains(tmp_path: Path):
    """A TRL step's rank on the Trainer's callbacks: its endpoint is registered for service discovery, serves the
    step, the loss TRL logged, the time of the last step and rank 0's goodput split under the labels the dashboard
    and the hang alert read, and is gone from discovery and closed when training ends."""
    import urllib.error
    from types import SimpleNamespace

    from prometheus_client.parser import text_string_to_metric_families

    from compass.model.training.job import Telemetry
    from compass.tasks.post_training.trl_goodput import TrlGoodput
    from compass.tasks.post_training.trl_prometheus import TrlPrometheus

    folder = tmp_path / "monitoring"
    ledger = TrlGoodput(tmp_path / "goodput", started_at=time.time() - 3, rank=0)  # 3 s of start-up
    served = TrlPrometheus(Telemetry(run="minimal", step="post_train:sft", folder=folder), ledger, cuda=False)
    state = SimpleNamespace(global_step=0, max_steps=2, is_world_process_zero=True)
    for callback in (ledger, served):  # the order trl_ranks gives them: the ledger first
        callback.on_train_begin(None, state, None)
    ledger.on_step_begin(None, state, None)
    time.sleep(0.05)
    state.global_step = 1
    for callback in (ledger, served):
        callback.on_step_end(None, state, None)
    served.on_log(None, state, None, logs={"loss": 2.5, "grad_norm": 0.75, "learning_rate": 1e-4, "epoch": 0.5})

    (target,) = (folder / "targets").glob("*.json")
    address = json.loads(target.read_text())[0]["targets"][0]
    samples = {(s.name, s.labels.get("cause")): s for family in text_string_to_metric_families(
        _get(f"http://{address}/metrics")) for s in family.samples}
    step = samples[("compass_train_step", None)]
    assert step.value == 1 and step.labels["step"] == "post_train:sft" and step.labels["stage"] == "sft"
    assert step.labels["run"] == "minimal" and step.labels["rank"] == "0"
    assert samples[("compass_train_loss", None)].value == 2.5
    assert samples[("compass_train_grad_norm", None)].value == 0.75
    assert samples[("compass_train_learning_rate", None)].value == 1e-4
    assert time.time() - samples[("compass_train_last_step_timestamp_seconds", None)].value < 60
    assert samples[("compass_train_stage_seconds", "startup")].value >= 3
    assert samples[("compass_train_stage_seconds", "compute")].value >= 0.05
    assert ("compass_host_memory_rss_bytes", None) in samples

    served.on_train_end(None, state, None)
    assert not list((folder / "targets").glob("*.json"))
    with pytest.raises(urllib.error.URLError):
        _get(f"http://{address}/metrics")
