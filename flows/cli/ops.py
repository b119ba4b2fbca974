"""Operations commands: a local Prefect server, the work pool and its worker, deployments, submitting specs as
runs, and the status of recent runs. Every command but `server` talks to the server in PREFECT_API_URL."""

from __future__ import annotations

import ipaddress
import json
import os
import shutil
import socket
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape
from rich.table import Table

from compass.flows.cli.common import (
    EXIT_BAD_INPUT,
    RehearseOption,
    SmokeOption,
    err,
    load,
    out,
    refuse_write_option,
    store_root,
)
from compass.flows.reports.recent_runs import recent_runs
from compass.flows.server.confinement import WORKER_SPECS, WORKER_STORE, worker_read_warnings
from compass.flows.server.database import DatabaseError, prefect_database_url, redacted, unreachable
from compass.flows.server.worker import serve

ops = typer.Typer()
LOOPBACK_NAMES = {"localhost"}
MIN_PASSWORD = 12  # basic auth is all that guards an exposed server


def _is_loopback(host: str) -> bool:
    if host in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False



def need_server(what: str) -> str:
    from prefect.settings import PREFECT_API_URL

    url = PREFECT_API_URL.value()
    if not url:
        err.print(f"{what} needs a Prefect server: start one with `compass server`, then "
                  "`export PREFECT_API_URL=http://127.0.0.1:4200/api`", markup=False)
        raise typer.Exit(EXIT_BAD_INPUT)
    return url

@ops.command()
def server(host: Annotated[str, typer.Option(help="Address to listen on.")] = "127.0.0.1",
           port: Annotated[int, typer.Option(help="Port for the API and the UI.")] = 4200,
           database: Annotated[str | None, typer.Option(
               help="The server's database: postgresql://user:password@host:5432/db for a team's shared server "
                    "(default: SQLite in the Prefect home, or PREFECT_API_DATABASE_CONNECTION_URL). "
                    "COMPASS_DATABASE_URL keeps the password off the command line.",
               envvar="COMPASS_DATABASE_URL", show_envvar=False)] = None) -> None:
    """Start a Prefect server (API and web UI) on 127.0.0.1; another address needs basic auth set."""

    env = dict(os.environ)
    if database:
        try:
            env["PREFECT_API_DATABASE_CONNECTION_URL"] = prefect_database_url(database)
        except DatabaseError as exc:
            err.print(str(exc), markup=False)
            raise typer.Exit(EXIT_BAD_INPUT) from None
        if why := unreachable(env["PREFECT_API_DATABASE_CONNECTION_URL"]):
            err.print(f"cannot use the database {redacted(database)}: {why}", markup=False)
            raise typer.Exit(1)
    if not _is_loopback(host) and not env.get("PREFECT_SERVER_API_AUTH_STRING"):
        err.print(f"refusing to listen on {host} without authentication: set "
                  "PREFECT_SERVER_API_AUTH_STRING='user:password' here and PREFECT_API_AUTH_STRING to the "
                  "same value on every client and worker", markup=False)
        raise typer.Exit(EXIT_BAD_INPUT)
    weak = _weak_auth(env.get("PREFECT_SERVER_API_AUTH_STRING", ""))
    if not _is_loopback(host) and weak:
        err.print(f"refusing to listen on {host}: PREFECT_SERVER_API_AUTH_STRING {weak}", markup=False)
        raise typer.Exit(EXIT_BAD_INPUT)
    env.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    reachable = socket.getfqdn() if host in ("0.0.0.0", "::") else host  # a browser elsewhere cannot call 0.0.0.0
    env.setdefault("PREFECT_SERVER_UI_API_URL", f"http://{reachable}:{port}/api")  # the UI calls the API here
    env.setdefault("DO_NOT_TRACK", "1")
    stored = redacted(database) if database else "SQLite in the Prefect home"
    out.print(f"Prefect server on http://{host}:{port} (UI), its database {stored}; clients: "
              f"export PREFECT_API_URL=http://{host}:{port}/api", markup=False)
    sys.stdout.flush()
    prefect = shutil.which("prefect", path=str(Path(sys.executable).parent)) or "prefect"
    os.execvpe(prefect, [prefect, "server", "start", "--host", host, "--port", str(port)], env)

def _weak_auth(auth: str) -> str:
    """Why a basic-auth string guards an exposed server badly ('' when it is fine)."""
    user, _, password = auth.partition(":")
    if not user or not password:
        return "must be 'user:password'"
    if len(password) < MIN_PASSWORD:
        return f"has a password of {len(password)} characters: use at least {MIN_PASSWORD}"
    return ""


@ops.command()
def worker(pool: Annotated[str, typer.Option(help="Process work pool to serve.")] = "compass",
           store: Annotated[str | None, typer.Option(
               help="This worker's store (a local folder): the only store its runs write (with its -smoke and "
                    "-rehearsal namespaces and COMPASS_ALLOWED_ROOTS), whatever store_root a submitter passes; "
                    "submitted specs may read local files under it. Without it the runs write where their spec "
                    "says.")] = None,
           specs: Annotated[Path | None, typer.Option(
               help="The folder this worker keeps submitted specs in: they may read local files under it.")] = None
           ) -> None:
    """Start a process worker on the work pool (created when missing); it runs submitted specs, which read local
    files only under its --store, its --specs and COMPASS_ALLOWED_ROOTS (never where the submitter says), and write
    only into its --store and COMPASS_ALLOWED_ROOTS when a --store is given (every folder a spec names included)."""
    refuse_write_option("--store", store, "the worker's runs")
    need_server("compass worker")
    from compass.flows.server.deployments import ensure_pool

    ensure_pool(pool)
    if store:  # the flow runs the worker starts inherit its environment
        os.environ[WORKER_STORE] = store if "://" in store else str(Path(store).expanduser().resolve())
    if specs:
        os.environ[WORKER_SPECS] = str(specs.expanduser().resolve())
    sys.stdout.flush()

    raise typer.Exit(serve(pool))

@ops.command()
def deploy(spec: Annotated[Path | None, typer.Argument(
               help="Optional spec: also deploy its scheduled evaluation and use its GPU slots.")] = None,
           pool: Annotated[str, typer.Option(help="Process work pool the deployments run on.")] = "compass",
           gpu_slots: Annotated[int | None, typer.Option(
               help="Most GPU-tagged steps running at once over all runs (default: the spec's "
                    "how.orchestration.max_parallel_gpu_steps, else 1).")] = None,
           as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output.")] = False) -> None:
    """Create or update the work pool, the deployments and the GPU concurrency limit on the server."""
    loaded = load(spec) if spec else None
    need_server("compass deploy")
    from compass.flows.server.deployments import deploy_all, ensure_gpu_limit, ensure_pool

    created = ensure_pool(pool)
    evaluation = None
    if loaded is not None:
        ev = loaded.spec.how.evaluation
        benchmarks = [t.model_dump(mode="json") for t in loaded.spec.what.evaluation.benchmarks]
        if benchmarks and (ev.schedule_interval_seconds or ev.schedule_cron):
            evaluation = {"name": f"evaluate-{loaded.spec.name}", "interval": ev.schedule_interval_seconds,
                          "cron": None if ev.schedule_interval_seconds else ev.schedule_cron,
                          "parameters": {"checkpoint_root": store_root(loaded, None), "benchmarks": benchmarks,
                                         "credentials_block": loaded.spec.how.storage.credentials_block,
                                         "how": loaded.spec.how.model_dump(mode="json")}}
    on_checkpoint = None
    if loaded is not None:
        how, benchmarks = loaded.spec.how, [t.model_dump(mode="json") for t in loaded.spec.what.evaluation.benchmarks]
        if benchmarks and how.evaluation.every_checkpoint and how.monitoring.checkpoint_events:
            on_checkpoint = {"spec": loaded.spec.name,
                             "parameters": {"benchmarks": benchmarks, "store_root": store_root(loaded, None),
                                            "credentials_block": how.storage.credentials_block,
                                            "how": how.model_dump(mode="json")}}
    slots = gpu_slots or (loaded.spec.how.orchestration.max_parallel_gpu_steps if loaded else 1)
    made = deploy_all(pool, evaluation, on_checkpoint)
    ensure_gpu_limit(slots)
    if as_json:
        print(json.dumps({"pool": pool, "pool_created": created, "gpu_slots": slots,
                          "deployments": [{"name": d.name, "schedule": d.schedule} for d in made]}))
        return
    out.print(f"work pool '{pool}' {'created' if created else 'exists'}; at most {slots} GPU step(s) at once",
              markup=False)
    for d in made:
        out.print(f"deployment {d.name}" + (f" ({d.schedule})" if d.schedule else ""), markup=False)
    out.print(f"start a worker: compass worker --pool {pool}", markup=False)

@ops.command()
def submit(spec: Annotated[Path, typer.Argument(help="Training spec (YAML).", show_default=False)],
           store: Annotated[str | None, typer.Option(
               help="Override how.storage.root. Without it a local root is the worker's --store (a folder of "
                    "this machine means nothing on the worker's), an s3:// root the spec's.")] = None,
           deployment: Annotated[str, typer.Option(help="Deployment to run.")] = "compass-lifecycle/lifecycle",
           until: Annotated[list[str] | None, typer.Option(
               help="Run only these steps (kind or step id) and the steps they need (repeatable).")] = None,
           watch: Annotated[bool, typer.Option(help="Follow state and logs until the run ends.")] = False,
           as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output.")] = False,
           smoke: SmokeOption = False, rehearse: RehearseOption = False) -> None:
    """Validate a spec here, then run it on the server's workers as a flow run of the lifecycle deployment (the
    worker checks its own machine: GPUs, extras, memory, credentials)."""
    checked = load(spec, until, smoke=smoke, machine=False, rehearse=rehearse)
    remote_root = "://" in checked.spec.how.storage.root and not checked.spec.how.storage.root.startswith("file://")
    root = store_root(checked, store) if store or remote_root else None  # None: the worker's --store decides
    need_server("compass submit")
    from prefect.exceptions import ObjectNotFound

    from compass.flows.reports.recent_runs import run_verdict
    from compass.flows.server.submit import submit as create_run
    from compass.flows.server.submit import ui_url
    from compass.flows.server.submit import watch as follow

    for line in worker_read_warnings(checked.spec, checked.loaded.base_dir):
        err.print(line, markup=False, highlight=False, soft_wrap=True)
    try:
        run = create_run(checked.loaded, str(spec), deployment, root, until)
    except ObjectNotFound:
        err.print(f"deployment '{deployment}' not found on the server: run `compass deploy` first", markup=False)
        raise typer.Exit(EXIT_BAD_INPUT) from None
    url = ui_url(run.id)
    if not as_json:
        out.print(f"submitted {run.name} ({run.id}) to {deployment}\n{url}", markup=False)
    final = run
    if watch:
        final = follow(run.id, (lambda line: print(line, file=sys.stderr)) if as_json else
                       (lambda line: out.print(line, markup=False, highlight=False)))
    state = final.state.name if final.state else "Scheduled"
    verdict = run_verdict(run.id) if watch else None
    if as_json:
        print(json.dumps({"id": str(run.id), "name": run.name, "url": url, "state": state,
                          "verdict": verdict.model_dump(mode="json") if verdict else None}))
    elif watch:
        out.print(f"{run.name}: {state}" + (f"; success criteria {verdict.headline()}" if verdict else ""),
                  markup=False)
        for criterion in verdict.criteria if verdict else ():
            out.print(f"  {criterion.line()}", markup=False)
    if watch and not (final.state and final.state.is_completed()):
        raise typer.Exit(1)

@ops.command()
def status(limit: Annotated[int, typer.Option(help="How many recent runs.")] = 10,
           as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output.")] = False) -> None:
    """Recent lifecycle runs on the server: state, current step, goodput (the share of its steps' time spent
    computing, and the largest badput), store location."""
    need_server("compass status")

    rows = recent_runs(limit)
    if as_json:
        print(json.dumps([r.as_dict() for r in rows], indent=2))
        return

    table = Table(title="compass runs", title_justify="left")
    for col in ("run", "state", "verdict", "started", "step", "done", "goodput", "bytes", "store", "deployment"):
        table.add_column(col, overflow="fold", no_wrap=col in ("state", "verdict"))
    for r in rows:
        table.add_row(*(escape(str(value)) for value in (r.name, r.state, r.verdict_cell(), r.started,
                                                         r.current_step, r.steps_done, r.goodput_cell(),
                                                         r.resources_cell(), r.store, r.deployment)))
    out.print(table)
