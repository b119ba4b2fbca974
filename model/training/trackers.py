"""Experiment trackers beside TensorBoard (how.monitoring.trackers): MLflow, Weights & Biases and trackio.

Every training, post-training and evaluation step is one tracker run, named after the step and grouped by the
spec's run (`<spec name>-<spec hash[:8]>`, the Prefect flow run's name), with the step's config and the spec hash
as parameters and every metric against tokens seen, as in TensorBoard: stages, ablation variants, post-training
and evaluations line up on one axis. A retried step continues its run (its identity is the step's fingerprint);
a changed step is a new run. Only rank 0 reports. Each library is used through its own client, configured the
way its users configure it (MLFLOW_TRACKING_URI, WANDB_* variables, TRACKIO_DIR).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from compass.infra.redact import redact

log = logging.getLogger("compass.trackers")

RemoteTracker = Literal["mlflow", "wandb", "trackio"]
REMOTE_TRACKERS: tuple[RemoteTracker, ...] = ("mlflow", "wandb", "trackio")


class TrackerRun(BaseModel):
    """Who one step's tracker run is and where it reports; serialisable, so training ranks started elsewhere
    (torchrun, srun) open the same run."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    trackers: tuple[RemoteTracker, ...]
    project: str  # MLflow experiment, W&B project, trackio project
    group: str  # the spec's run: <spec name>-<spec hash[:8]>
    name: str  # the step: pretrain:stable
    kind: str  # the step's kind: W&B's job type
    key: str  # <kind>/<name>-<fingerprint[:12]>: the same step (a retry) continues its run
    params: dict[str, str]  # the step's config (flattened) and the spec hash
    folder: Path  # W&B's run folders go under <folder>/wandb
    mlflow_tracking_uri: str | None = None
    wandb_mode: Literal["offline", "online"] = "offline"

    @property
    def run_id(self) -> str:
        """A stable id of this step's run (W&B's run id, trackio's run name suffix)."""
        return hashlib.sha256(f"{self.project}\0{self.group}\0{self.key}".encode()).hexdigest()[:16]


def flat_params(config: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """A nested config as `a.b.c: value` strings (MLflow keeps parameters as strings of at most 6000 chars)."""
    out: dict[str, str] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            out.update(flat_params(value, f"{name}."))
        else:
            text = value if isinstance(value, str) else json.dumps(value, default=str)
            out[name] = text[:6000]
    return out


class _Sink:
    def log(self, metrics: Mapping[str, float], tokens: int) -> None: ...
    def close(self, failed: bool) -> None: ...


FAIL_FAST = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "1", "MLFLOW_HTTP_REQUEST_TIMEOUT": "10",
             "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1"}


class _Mlflow(_Sink):
    """MlflowClient against the tracking server (no fluent global state: steps run on threads side by side)."""

    def __init__(self, run: TrackerRun):

        for name, value in FAIL_FAST.items():  # a server that does not answer costs seconds, not MLflow's ~5 minutes
            os.environ.setdefault(name, value)  # (7 retries with backoff, 120 s per request); a user's own wins
        from mlflow import MlflowClient
        from mlflow.entities import Param

        self.client = MlflowClient(tracking_uri=run.mlflow_tracking_uri)  # None: MLFLOW_TRACKING_URI
        experiment = self._experiment(run.project)
        found = self.client.search_runs(
            [experiment], filter_string=f"tags.`compass.run_id` = '{run.run_id}' and attributes.status != 'FINISHED'",
            max_results=1)
        if found:  # a retried step continues its run
            self.run_id = found[0].info.run_id
            self.client.update_run(self.run_id, status="RUNNING")
            return
        created = self.client.create_run(experiment, run_name=run.name, tags={
            "compass.run_id": run.run_id, "compass.group": run.group, "compass.step": run.name,
            "compass.kind": run.kind, "compass.key": run.key})
        self.run_id = created.info.run_id
        self.client.log_batch(self.run_id, params=[Param(k, v) for k, v in sorted(run.params.items())])
        self.client.log_dict(self.run_id, {"step": run.name, "group": run.group, "params": run.params},
                             "compass/step.json")

    def _experiment(self, name: str) -> str:
        from mlflow.exceptions import MlflowException

        found = self.client.get_experiment_by_name(name)
        if found is not None:
            return found.experiment_id
        try:
            return self.client.create_experiment(name)
        except MlflowException:  # another step created it meanwhile
            found = self.client.get_experiment_by_name(name)
            if found is None:
                raise
            return found.experiment_id

    def log(self, metrics: Mapping[str, float], tokens: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, float(v), now, tokens) for k, v in metrics.items()])

    def close(self, failed: bool) -> None:
        self.client.set_terminated(self.run_id, "FAILED" if failed else "FINISHED")


class _Wandb(_Sink):
    """A W&B run per step (offline by default: the run folder holds the history until `wandb sync`)."""

    def __init__(self, run: TrackerRun):
        import wandb

        run.folder.mkdir(parents=True, exist_ok=True)  # W&B writes its run folders under <folder>/wandb
        self.run = wandb.init(project=run.project, group=run.group, name=run.name, job_type=run.kind,
                              id=run.run_id, resume="allow", dir=str(run.folder), mode=run.wandb_mode,
                              config={**run.params, "compass.key": run.key}, reinit="create_new",
                              settings=wandb.Settings(silent=True, console="off"))
        self.run.define_metric("tokens")
        self.run.define_metric("*", step_metric="tokens")

    def log(self, metrics: Mapping[str, float], tokens: int) -> None:
        self.run.log({**metrics, "tokens": tokens})

    def close(self, failed: bool) -> None:
        self.run.finish(exit_code=1 if failed else 0)


class _Trackio(_Sink):
    """A trackio run per step in trackio's local database (TRACKIO_DIR), or its server when trackio names one."""

    def __init__(self, run: TrackerRun):
        import trackio

        self.run = trackio.init(project=run.project, name=f"{run.name}-{run.run_id[:8]}", group=run.group,
                                config={**run.params, "compass.key": run.key}, resume="allow", embed=False,
                                auto_log_gpu=False, auto_log_cpu=False)

    def log(self, metrics: Mapping[str, float], tokens: int) -> None:
        self.run.log({**metrics, "tokens": tokens}, step=tokens)

    def close(self, failed: bool) -> None:
        self.run.finish()


SINKS: dict[str, type[_Sink]] = {"mlflow": _Mlflow, "wandb": _Wandb, "trackio": _Trackio}


class Trackers:
    """The open runs of one step. A tracker that fails to open or to take a point is reported once and left
    out: a tracking server's outage never fails a training step (its numbers are in the metrics history and
    the manifest either way)."""

    def __init__(self, run: TrackerRun):
        self.run = run
        self.sinks: dict[str, _Sink] = {}
        for name in run.trackers:
            try:
                self.sinks[name] = SINKS[name](run)
            except Exception as exc:  # noqa: BLE001 - a tracker's failure must not fail the step
                log.warning("%s: %s run not opened (%s: %s); training goes on without it", run.name, name,
                            type(exc).__name__, redact(str(exc)))

    def log(self, metrics: Mapping[str, float | int | None], tokens: int) -> None:
        values = {k: float(v) for k, v in metrics.items() if isinstance(v, int | float) and not isinstance(v, bool)}
        if not values:
            return
        for name, sink in list(self.sinks.items()):
            try:
                sink.log(values, tokens)
            except Exception as exc:  # noqa: BLE001
                log.warning("%s: %s stopped taking metrics (%s: %s); left out from now on", self.run.name, name,
                            type(exc).__name__, redact(str(exc)))
                del self.sinks[name]

    def close(self, failed: bool = False) -> None:
        for name, sink in self.sinks.items():
            try:
                sink.close(failed)
            except Exception as exc:  # noqa: BLE001
                log.warning("%s: %s run not closed cleanly (%s: %s)", self.run.name, name, type(exc).__name__,
                            redact(str(exc)))
        self.sinks = {}
