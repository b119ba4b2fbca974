"""`compass monitor SPEC`: a Prometheus on loopback over the run's monitoring folder, reading every training rank's
endpoint from the files the ranks register and evaluating the shipped alert rules; it prints where TensorBoard
and the Grafana dashboard are, and runs until Ctrl-C."""

from __future__ import annotations

import signal
import sys
from pathlib import Path
from typing import Annotated

import typer

from compass.flows.cli.common import EXIT_BAD_INPUT, SpecArg, err, load, out, store_root
from compass.infra import prometheus


def monitoring_folder(spec: Path, store: str | None = None) -> Path:
    from compass.infra.store import Store
    from compass.tasks.steps.context import Runtime

    checked = load(spec, machine=False)
    runtime = Runtime(how=checked.spec.how, base_dir=checked.loaded.base_dir, run=checked.spec.name)
    return runtime.monitoring_dir(Store(store_root(checked, store)), Path.cwd())


def monitor(spec: SpecArg,
            port: Annotated[int, typer.Option(help="Prometheus's port (UI and API).")] = 9090,
            listen: Annotated[str, typer.Option(help="Address Prometheus listens on.")] = "127.0.0.1",
            scrape_interval: Annotated[float, typer.Option(min=1.0, help="Seconds between scrapes.")] = 5.0,
            store: Annotated[str | None, typer.Option(help="Override how.storage.root.")] = None) -> None:
    """Start Prometheus over the run's training ranks, with compass's alert rules."""

    folder = monitoring_folder(spec, store)
    try:
        process = prometheus.start(folder, port, listen, scrape_interval, tied=True)
    except FileNotFoundError as exc:
        err.print(str(exc), markup=False)
        raise typer.Exit(EXIT_BAD_INPUT) from None
    out.print(f"Prometheus on http://{listen}:{port} (pid {process.pid}) over {folder / 'targets'}; "
              f"alert rules {prometheus.RULES}", markup=False, highlight=False)
    out.print(f"Grafana: import {prometheus.DASHBOARD} (Prometheus data source at http://{listen}:{port})",
              markup=False, highlight=False)
    out.print(f"TensorBoard: tensorboard --logdir {folder / 'tensorboard'} --host 127.0.0.1", markup=False,
              highlight=False)
    sys.stdout.flush()
    signal.signal(signal.SIGTERM, lambda *_: process.terminate())
    try:
        code = process.wait()
    except KeyboardInterrupt:
        process.terminate()
        code = process.wait()
    if code not in (0, -signal.SIGTERM):
        err.print(f"prometheus exited with {code}; see {folder / 'prometheus.log'}", markup=False)
        raise typer.Exit(1)
