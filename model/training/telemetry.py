"""Live telemetry of every training rank, the playbook's three layers: algorithm (loss, grad norm, LR), system
(throughput, MFU, where each step's time went, host memory and CPU) and hardware (GPU temperature, power, clocks,
utilisation, memory, throttling, ECC through NVML on CUDA).

- `PrometheusExporter`: one endpoint per rank (prometheus-client), registered for Prometheus's file service
  discovery under the run's monitoring folder while the rank trains, removed when it ends;
- `TensorBoardLog`: event files per training step (rank 0), tokens on the x axis so stages and ablation
  variants compare in one TensorBoard;
- `TrackerLog`: the same scalars to the spec's other trackers (MLflow, W&B, trackio: model/training/trackers.py).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
from prometheus_client import CollectorRegistry, Gauge, start_wsgi_server
from prometheus_client.core import GaugeMetricFamily

from compass.model.training.callbacks import Callback
from compass.model.training.job import Telemetry
from compass.model.training.loop_view import TrainingLoop
from compass.model.training.records import CAUSES, PHASES, GoodputSplit, MetricsRow
from compass.model.training.trackers import TrackerRun, Trackers

LABELS = ("run", "step", "stage", "node", "rank")

# name -> (help, extra label): what every rank exposes; the Grafana dashboard and the alert rules use only these
TRAINING_METRICS: dict[str, tuple[str, str | None]] = {
    "compass_train_step": ("Optimizer steps over every stage of the schedule", None),
    "compass_train_loss": ("Training loss of the last step (mean over ranks)", None),
    "compass_train_grad_norm": ("Gradient norm of the last step, before clipping", None),
    "compass_train_learning_rate": ("Learning rate of the last step", None),
    "compass_train_tokens": ("Tokens seen over every stage", None),
    "compass_train_tokens_per_second": ("Tokens per second of the last step (global batch)", None),
    "compass_train_mfu": ("Model FLOPs utilisation of the last step", None),
    "compass_train_step_seconds": ("Wall time of the last step", None),
    "compass_train_phase_seconds": ("Where the last step's time went", "phase"),
    "compass_train_last_step_timestamp_seconds": ("Unix time the last step ended (a hung rank stops it)", None),
    "compass_train_stage_seconds": ("The stage's wall time so far over every attempt, by cause: compute is the "
                                    "goodput, the rest badput (rank 0; model/training/goodput.py)", "cause"),
}
GOODPUT_EVERY_S = 10.0  # the ledger is read from the work folder: not at every step
HOST_METRICS: dict[str, tuple[str, str | None]] = {
    "compass_host_memory_rss_bytes": ("Resident memory of this rank's process", None),
    "compass_host_cpu_percent": ("CPU use of this rank's process (100 = one core)", None),
}
GPU_METRICS: dict[str, tuple[str, str | None]] = {
    "compass_gpu_temperature_celsius": ("GPU temperature", None),
    "compass_gpu_power_watts": ("GPU power draw", None),
    "compass_gpu_sm_clock_mhz": ("GPU SM clock", None),
    "compass_gpu_utilization_percent": ("GPU utilisation", None),
    "compass_gpu_memory_used_bytes": ("GPU memory in use", None),
    "compass_gpu_throttling": ("1 while the GPU slows itself down for this reason", "reason"),
    "compass_gpu_ecc_errors_uncorrected": ("Uncorrected ECC errors since the driver loaded", None),
}
EXPOSED = {**TRAINING_METRICS, **HOST_METRICS, **GPU_METRICS}


class _HostAndDevice:
    """Read at scrape time, so a rank that hangs still reports its memory, CPU and GPU."""

    def __init__(self, labels: dict[str, str], gpu_index: int | None):

        self.labels, self.gpu_index = labels, gpu_index
        self.process = psutil.Process()
        self.process.cpu_percent()  # the first reading is meaningless: start the interval now

    def collect(self) -> Iterator[Any]:

        def family(name: str, extra: str | None = None) -> GaugeMetricFamily:
            return GaugeMetricFamily(name, EXPOSED[name][0], labels=[*LABELS, *([extra] if extra else [])])

        values = list(self.labels.values())
        rss, cpu = family("compass_host_memory_rss_bytes"), family("compass_host_cpu_percent")
        with contextlib.suppress(Exception):
            rss.add_metric(values, self.process.memory_info().rss)
            cpu.add_metric(values, self.process.cpu_percent())
        yield from (rss, cpu)
        if self.gpu_index is not None:
            yield from self._gpu(values, family)

    def _gpu(self, values: list[str], family: Any) -> Iterator[Any]:
        import pynvml

        from compass.model.training.preflight import BAD_THROTTLES

        pynvml.nvmlInit()
        try:
            handle = pynvml.nvmlDeviceGetHandleByIndex(self.gpu_index)
            readings = {
                "compass_gpu_temperature_celsius": lambda: pynvml.nvmlDeviceGetTemperature(
                    handle, pynvml.NVML_TEMPERATURE_GPU),
                "compass_gpu_power_watts": lambda: pynvml.nvmlDeviceGetPowerUsage(handle) / 1000,
                "compass_gpu_sm_clock_mhz": lambda: pynvml.nvmlDeviceGetClockInfo(handle, pynvml.NVML_CLOCK_SM),
                "compass_gpu_utilization_percent": lambda: pynvml.nvmlDeviceGetUtilizationRates(handle).gpu,
                "compass_gpu_memory_used_bytes": lambda: pynvml.nvmlDeviceGetMemoryInfo(handle).used,
                "compass_gpu_ecc_errors_uncorrected": lambda: pynvml.nvmlDeviceGetTotalEccErrors(
                    handle, pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, pynvml.NVML_VOLATILE_ECC),
            }
            for name, read in readings.items():
                metric = family(name)
                with contextlib.suppress(pynvml.NVMLError):
                    metric.add_metric(values, float(read()))
                yield metric
            throttling = family("compass_gpu_throttling", "reason")
            with contextlib.suppress(pynvml.NVMLError):
                reasons = pynvml.nvmlDeviceGetCurrentClocksThrottleReasons(handle)
                for bit, reason in BAD_THROTTLES.items():
                    throttling.add_metric([*values, reason], float(bool(reasons & bit)))
            yield throttling
        finally:
            pynvml.nvmlShutdown()


class RankEndpoint:
    """One rank's Prometheus endpoint: the training gauges and the host and device readings, served while the rank
    trains and registered for Prometheus's file service discovery under the run's monitoring folder. The compass
    trainer's exporter (below) and TRL's (tasks/post_training/trl_prometheus.py) fill the same gauges."""

    def __init__(self, telemetry: Telemetry, labels: dict[str, str], local_rank: int, gpu_index: int | None):

        self.labels = labels
        self.values = list(labels.values())
        registry = CollectorRegistry()
        self.gauges = {name: Gauge(name, help_text, [*LABELS, *([extra] if extra else [])], registry=registry)
                       for name, (help_text, extra) in TRAINING_METRICS.items()}
        registry.register(_HostAndDevice(labels, gpu_index))
        port = telemetry.port + local_rank if telemetry.port else 0
        self.server: Any
        self.server, _ = start_wsgi_server(port, addr=telemetry.listen, registry=registry)
        listen = telemetry.listen
        host = socket.gethostname() if listen in ("0.0.0.0", "::") else listen
        address = f"[{host}]:{self.server.server_port}" if ":" in host else f"{host}:{self.server.server_port}"
        self.target: Path | None = register_target(telemetry.folder, address, labels)

    def set(self, name: str, value: float, *extra: str) -> None:
        self.gauges[name].labels(*self.values, *extra).set(value)

    def set_goodput(self, split: GoodputSplit) -> None:
        """The stage's wall time so far by cause (compass_train_stage_seconds)."""
        for cause in ("compute", *CAUSES):
            self.set("compass_train_stage_seconds", getattr(split, f"{cause}_s"), cause)

    def close(self) -> None:
        """Unregistered first (Prometheus stops scraping it), then the server stopped."""
        if self.target is not None:
            self.target.unlink(missing_ok=True)
            self.target = None
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
            self.server = None


class PrometheusExporter(Callback):
    """Serves this rank's metrics while it trains and registers the endpoint in `<folder>/targets/`."""

    def __init__(self, telemetry: Telemetry):
        self.telemetry = telemetry
        self.endpoint: RankEndpoint | None = None
        self.goodput_at = 0.0

    def on_start(self, trainer: TrainingLoop) -> None:
        t = self.telemetry
        labels = {"run": t.run, "step": t.step, "stage": trainer.stage.name, "node": socket.gethostname(),
                  "rank": str(trainer.rank)}
        cuda = trainer.device.type == "cuda"
        self.endpoint = RankEndpoint(t, labels, _dist()[2], trainer.device.index if cuda else None)

    def post_step(self, trainer: TrainingLoop, row: MetricsRow) -> None:
        endpoint = self.endpoint
        if endpoint is None:
            return
        for name, key in (("compass_train_step", "step"), ("compass_train_loss", "loss"),
                          ("compass_train_grad_norm", "grad_norm"), ("compass_train_learning_rate", "lr"),
                          ("compass_train_tokens", "tokens"), ("compass_train_tokens_per_second", "tokens_per_s"),
                          ("compass_train_mfu", "mfu")):
            endpoint.set(name, getattr(row, key) or 0.0)
        total = 0.0
        for phase in PHASES:
            seconds = row.seconds(phase)
            total += seconds
            endpoint.set("compass_train_phase_seconds", seconds, phase)
        endpoint.set("compass_train_step_seconds", total)
        endpoint.set("compass_train_last_step_timestamp_seconds", time.time())
        if time.monotonic() - self.goodput_at >= GOODPUT_EVERY_S or trainer.step == trainer.stage_steps:
            self.goodput_at = time.monotonic()
            split = trainer.ledger.live()
            if split is not None:
                endpoint.set_goodput(split)

    def on_end(self, trainer: TrainingLoop) -> None:
        self.close()

    def on_error(self, trainer: TrainingLoop, exc: BaseException) -> None:
        self.close()

    def close(self) -> None:
        if self.endpoint is not None:
            self.endpoint.close()
            self.endpoint = None


def register_target(folder: Path, address: str, labels: dict[str, str]) -> Path:
    """One file_sd file per rank (written whole, then renamed: Prometheus watches the folder)."""
    targets = folder / "targets"
    targets.mkdir(parents=True, exist_ok=True)
    name = re.sub(r"[^A-Za-z0-9_.-]", "_", f"{labels['step']}-{labels['node']}-rank{labels['rank']}")
    path = targets / f"{name}.json"
    tmp = path.with_suffix(f".tmp-{os.getpid()}")
    tmp.write_text(json.dumps([{"targets": [address], "labels": {"compass_run": labels["run"]}}]))
    tmp.rename(path)
    return path


def tensorboard_run(folder: Path, step: str) -> Path:
    """The TensorBoard run of one step (`pretrain:stable` -> tensorboard/pretrain.stable)."""
    return folder / "tensorboard" / re.sub(r"[^A-Za-z0-9_.-]", "_", step.replace(":", "."))


class TensorBoardLog(Callback):
    """Scalars of every step against tokens seen (rank 0); a resumed stage purges what it trains again."""

    def __init__(self, telemetry: Telemetry):
        self.telemetry = telemetry
        self.writer: Any = None

    def on_start(self, trainer: TrainingLoop) -> None:
        if trainer.rank != 0:
            return
        from torch.utils.tensorboard import SummaryWriter

        tokens = trainer.job.tokens_before + trainer.global_step * trainer.tokens_per_step
        self.writer = SummaryWriter(str(tensorboard_run(self.telemetry.folder, self.telemetry.step)),
                                    purge_step=tokens + 1 if trainer.global_step else None)

    def post_step(self, trainer: TrainingLoop, row: MetricsRow) -> None:
        if self.writer is None:
            return
        for name, value in step_scalars(row).items():
            self.writer.add_scalar(name, value, row.tokens)

    def on_end(self, trainer: TrainingLoop) -> None:
        self.close()

    def on_error(self, trainer: TrainingLoop, exc: BaseException) -> None:
        self.close()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None


def step_scalars(row: MetricsRow) -> dict[str, float]:
    """What every tracker plots of one optimizer step: the algorithm's numbers and where the step's time went."""
    out = {f"train/{key}": getattr(row, key) for key in ("loss", "grad_norm", "lr", "tokens_per_s", "mfu")
           if getattr(row, key) is not None}
    out |= {f"time/{phase}_s": row.seconds(phase) for phase in PHASES if getattr(row, f"{phase}_s") is not None}
    return out


class TrackerLog(Callback):
    """Rank 0 reports every step to the spec's MLflow, W&B and trackio runs, against tokens seen."""

    def __init__(self, run: TrackerRun):
        self.run = run
        self.trackers: Trackers | None = None

    def on_start(self, trainer: TrainingLoop) -> None:
        if trainer.rank == 0:
            self.trackers = Trackers(self.run)

    def post_step(self, trainer: TrainingLoop, row: MetricsRow) -> None:
        if self.trackers is not None:
            self.trackers.log(step_scalars(row), row.tokens)

    def on_end(self, trainer: TrainingLoop) -> None:
        self._close(failed=False)

    def on_error(self, trainer: TrainingLoop, exc: BaseException) -> None:
        self._close(failed=True)

    def _close(self, failed: bool) -> None:
        if self.trackers is not None:
            self.trackers.close(failed)
            self.trackers = None


def telemetry_callbacks(telemetry: Telemetry | None) -> list[Callback]:
    if telemetry is None:
        return []
    return ([PrometheusExporter(telemetry)] if telemetry.prometheus else []) + (
        [TensorBoardLog(telemetry)] if telemetry.tensorboard else []) + (
        [TrackerLog(telemetry.trackers)] if telemetry.trackers is not None else [])


def _dist() -> tuple[int, int, int]:
    from compass.model.training.collectives import rank_env

    return rank_env()
