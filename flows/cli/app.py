"""The `compass` command line: validate, plan, why, run, lineage, schema."""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.markup import escape
from rich.table import Table
from rich.tree import Tree

from compass.flows.cli.common import (
    EXIT_BAD_INPUT,
    MachineChecksOption,
    RehearseOption,
    SmokeOption,
    SpecArg,
    err,
    load,
    out,
    refuse_write_file_option,
    store_root,
)
from compass.flows.cli.monitor import monitor
from compass.flows.cli.ops import ops
from compass.flows.cli.preflight import preflight
from compass.flows.cli.why import why
from compass.flows.quiet_console import quiet_console
from compass.flows.reports.run_summary import RunSummary
from compass.flows.validation import checked_for_this_run
from compass.infra.credentials import CredentialsBlockError, apply_credentials_block
from compass.infra.environment import prepare_environment
from compass.infra.errors import DataError, DiskFull, RunStopped
from compass.infra.redact import prefect_links_without_userinfo
from compass.infra.temporary_server import start_tied_temporary_server
from compass.specs.file_stamp import FileStamp
from compass.specs.loader import SpecError
from compass.specs.scaling import throughput_from_preflight
from compass.specs.spec import TrainingSpec

if TYPE_CHECKING:
    from compass.flows.validation import CheckedSpec
    from compass.infra.store import Store

app = typer.Typer(help="compass: a declarative workflow DAG for training a small language model.",
                  no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False)


@app.callback()
def _every_command(ctx: typer.Context) -> None:
    """compass: a declarative workflow DAG for training a small language model."""
    ctx.with_resource(prefect_links_without_userinfo())  # a login in PREFECT_API_URL is never printed


app.add_typer(ops)  # server, worker, deploy, submit, status
app.command()(preflight)
app.command()(monitor)
app.command()(why)


@app.command()
def validate(spec: SpecArg, smoke: SmokeOption = False, rehearse: RehearseOption = False,
             machine_checks: MachineChecksOption = True) -> None:
    """Check a spec: schema, cross-field rules and machine checks; every problem with its file:line. Exit 0: valid;
    2: problems (nothing written)."""
    checked = load(spec, smoke=smoke, machine=machine_checks, rehearse=rehearse)
    s = checked.spec
    start = f", from {s.what.model.init_from}" if s.what.model else ""
    out.print(f"[green]ok[/green] {escape(str(spec))}: '{s.name}' ({s.why.reason}){escape(start)}, "
              f"{len(s.what.data.sources)} sources, "
              f"{len(s.what.pretraining.stages)} pretraining stages, {len(checked.plan.steps)} steps, spec hash "
              f"{checked.loaded.spec_hash[:12]}")


@app.command()
def plan(spec: SpecArg,
         store: Annotated[str | None, typer.Option(help="Override how.storage.root.")] = None,
         as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output.")] = False,
         smoke: SmokeOption = False,
         rehearse: RehearseOption = False,
         machine_checks: MachineChecksOption = True,
         preflight: Annotated[Path | None, typer.Option(
             help="A `compass preflight --json` report: plan GPUs from its measured throughput instead of the "
                  "assumed MFU.")] = None) -> None:
    """Print the DAG (fingerprints, outputs, what would run and why) and the cost estimate."""
    checked = load(spec, smoke=smoke, machine=machine_checks, rehearse=rehearse)
    loaded = checked.loaded
    tflops = None
    if preflight is not None:

        try:
            tflops = throughput_from_preflight(json.loads(preflight.read_text()),
                                               loaded.spec.how.hardware.assumed_mfu)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            err.print(f"{preflight}: not a readable `compass preflight --json` report ({exc})", markup=False)
            raise typer.Exit(EXIT_BAD_INPUT) from None
    from compass.flows.reports.mixture import consumption_section, source_sizes
    from compass.flows.reports.plan_status import plan_status
    from compass.flows.reports.plan_tables import cost_sections, dag_section, print_sections
    from compass.infra.store import Store

    target = Store(store_root(checked, store), create=False)  # a plan writes nothing
    statuses = plan_status(checked.plan, target)
    new_store = not target.is_remote and not Path(target.root).exists()
    sections = [dag_section(checked.plan, statuses, target.root, new_store), *cost_sections(loaded.spec, tflops),
                consumption_section(loaded.spec, source_sizes(checked.plan, statuses, target))]
    if as_json:
        print(json.dumps({"spec": loaded.spec.name, "spec_hash": loaded.spec_hash,
                          "sections": [{"title": s.title, "columns": s.columns, "rows": s.rows, "notes": s.notes}
                                       for s in sections]}, indent=2, default=str))
        return
    out.print(f"[bold]compass plan[/bold] {escape(str(spec))}: '{loaded.spec.name}', spec hash "
              f"{loaded.spec_hash[:12]}\n")
    print_sections(sections, out)


@app.command()
def run(spec: SpecArg,
        store: Annotated[str | None, typer.Option(help="Override how.storage.root.")] = None,
        until: Annotated[list[str] | None, typer.Option(
            help="Run only these steps (a kind such as pretrain, or a step id such as pretrain:stage1) and the "
                 "steps they need (repeatable).")] = None,
        as_json: Annotated[bool, typer.Option("--json", help="Print the run summary as JSON.")] = False,
        smoke: SmokeOption = False,
        rehearse: RehearseOption = False,
        no_recompute: Annotated[bool, typer.Option(
            "--no-recompute", help="Stop at a cached artifact whose files changed since its commit, instead of "
                                   "setting it aside and recomputing it (how.storage.on_damage: stop).")] = False,
        verbose: Annotated[bool, typer.Option(
            "--verbose", help="Show everything the run prints (libraries' progress bars and warnings, datatrove's "
                              "logs, the ranks' output) instead of writing it to the run's log file.")] = False
        ) -> None:
    """Run the lifecycle as a Prefect flow (embedded server unless PREFECT_API_URL is set)."""
    checked = load(spec, until, smoke=smoke, rehearse=rehearse)
    loaded = checked.loaded
    root = store_root(checked, store)  # a root that cannot hold a store stops here, before any server starts
    prepare_environment()
    started = time.time()
    if verbose:
        with _stdout_to_stderr(as_json):  # libraries print progress to stdout; --json keeps stdout for the summary
            summary = _run(spec, checked, root, until, no_recompute)
    else:

        log_path = Path(".compass") / "logs" / f"{loaded.spec.name}-{time.strftime('%Y%m%d-%H%M%S')}.log"
        err.print(f"everything else the run prints: {log_path} (--verbose shows it here)", markup=False,
                  highlight=False)
        with quiet_console(log_path.resolve(), (out, err)):
            summary = _run(spec, checked, root, until, no_recompute)
    _print_summary(spec, summary, as_json, started, table=verbose, log_path=None if verbose else log_path)


def _run(spec: Path, checked: CheckedSpec, root: str, until: list[str] | None, no_recompute: bool) -> dict:
    """The lifecycle flow on the embedded (or PREFECT_API_URL's) server, handed the spec checked here (not loaded
    and checked again); exits 2, 3 or 1 as `compass run` says."""
    from compass.flows.lifecycle import RayNeedsServer, lifecycle, task_runner_for

    loaded = checked.loaded

    try:
        runner = task_runner_for(loaded.spec.how.orchestration)  # refused before a temporary server starts
        start_tied_temporary_server()
        apply_credentials_block(loaded.spec.how.storage.credentials_block)  # fail here, before any flow run
    except (RayNeedsServer, CredentialsBlockError) as exc:
        err.print(f"[red]error:[/red] {escape(str(spec))}: {escape(str(exc))}")
        raise typer.Exit(2) from None
    except DiskFull as full:  # Prefect's home: nothing ran
        err.print(f"failed: {spec}: {full.strerror}", markup=False, highlight=False)
        raise typer.Exit(1) from None
    flow = lifecycle.with_options(task_runner=runner, flow_run_name=f"{loaded.spec.name}-{loaded.spec_hash[:8]}")

    try:
        with checked_for_this_run(checked):
            summary = flow(spec_yaml=loaded.text, spec_path=str(spec), base_dir=str(loaded.base_dir), store_root=root,
                           until=until, smoke=loaded.size == "smoke", rehearse=loaded.size == "rehearsal",
                           no_recompute=no_recompute)
    except RunStopped as stopped:  # the gate: an existing model already does the job
        err.print(f"[yellow]stopped:[/yellow] {escape(str(spec))}: {escape(str(stopped))}", highlight=False)
        raise typer.Exit(3) from None
    except DataError as failed:  # its message says where (file:line, the full disk's path); committed steps stay
        err.print(f"failed: {spec}: {failed}", markup=False, highlight=False)
        raise typer.Exit(1) from None
    return summary


def _print_summary(spec: Path, returned: dict, as_json: bool, started: float, table: bool,
                   log_path: Path | None = None) -> None:
    """The run's outcome: JSON, or the success criteria's verdict, where the report, plots, log and Prefect run are,
    and a line of counts (each step's commit line said where it went), with a table of every step under
    --verbose."""
    if as_json:
        print(json.dumps(returned, indent=2))
        return
    summary = RunSummary.model_validate(returned)

    if table:
        steps = Table(title=f"compass run: {escape(summary.spec)}", title_justify="left")
        for col in ("step", "state", "seconds", "output"):
            steps.add_column(col, overflow="fold")
        for r in summary.steps:
            steps.add_row(r.step, "[green]ran[/green]" if r.executed else "cached",
                          str(r.seconds) if r.executed else "-", escape(r.uri))
        out.print(steps)
    for size, rows in (("smoke", summary.smoke), ("rehearsal", summary.rehearsal)):
        if rows:
            shrunk = Table(title=f"{size} run of {escape(str(spec))}: what each step exercised and what was shrunk",
                           title_justify="left", show_lines=True)
            for col in ("step", "exercised", "shrunk"):
                shrunk.add_column(col, overflow="fold")
            for row in rows:
                shrunk.add_row(row["step"], escape(row["exercised"]), escape(row["shrunk"]))
            out.print(shrunk)
    from compass.flows.reports.run_outcome import outcome_lines

    for line in outcome_lines(summary.outcome, str(log_path) if log_path else None):  # whole lines: paths stay copyable
        out.print(line, markup=False, highlight=False, soft_wrap=True)
    ran = len(summary.ran)
    left_out = f", {len(summary.left_out)} left out by --until" if summary.left_out else ""
    out.print(f"{ran} ran, {len(summary.steps) - ran} cached{left_out}; {time.time() - started:.0f}s. "
              f"Results: {summary.store}", markup=False, soft_wrap=True)


@contextmanager
def _stdout_to_stderr(active: bool) -> Iterator[None]:
    """Point file descriptor 1 at stderr, so even C-level and early-bound writers leave stdout alone."""
    if not active:
        yield
        return
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


@app.command()
def lineage(uri: Annotated[str, typer.Argument(help="Artifact folder, file or manifest (local or s3://).")],
            as_json: Annotated[bool, typer.Option("--json")] = False) -> None:
    """Print an artifact's ancestry back to the raw sources, from manifests alone."""
    from compass.infra.lineage import LineageError
    from compass.infra.lineage import lineage as walk

    try:
        tree = walk(uri)
    except LineageError as exc:
        err.print(f"{uri}: {exc} (give a path inside a committed artifact of the store)", markup=False)
        raise typer.Exit(EXIT_BAD_INPUT) from None
    if as_json:
        print(json.dumps(tree, indent=2))
        return
    root = Tree(_label(tree))
    _grow(root, tree)
    out.print(root)


VERIFY_SHOWN = 10  # problems printed per damaged artifact


@app.command()
def verify(store: Annotated[str, typer.Argument(help="Store root (local folder or s3://bucket/prefix).")],
           set_aside: Annotated[bool, typer.Option("--set-aside", help="Move damaged artifacts aside so their "
                                                   "steps run again.")] = False,
           full: Annotated[bool, typer.Option("--full", help="Hash every file, even those whose size, mtime and "
                                              "inode are unchanged since they were last hashed.")] = False,
           as_json: Annotated[bool, typer.Option("--json")] = False) -> None:
    """Check every committed artifact's files against its manifest; exit 1 when any is damaged."""
    from compass.infra import verify as check

    target = _existing_store(store)
    report = {uri: check.damage(target, uri, "full" if full else "stamped") for uri in check.committed(target)}
    damaged = {uri: problems for uri, problems in report.items() if problems}
    moved = {uri: check.set_aside(target, uri) for uri in damaged} if set_aside else {}
    if as_json:
        print(json.dumps({"checked": len(report), "damaged": damaged, "set_aside": moved}, indent=2))
    else:
        for uri, problems in damaged.items():
            aside = f" -> set aside at {escape(moved[uri])}" if uri in moved else ""
            out.print(f"[red]damaged[/red] {escape(uri)}{aside}: {len(problems):,} problem"
                      f"{'s' if len(problems) != 1 else ''}")
            for problem in problems[:VERIFY_SHOWN]:  # a million-shard artifact: a summary, not a million lines
                out.print(f"  {problem}", markup=False)
            if len(problems) > VERIFY_SHOWN:
                out.print(f"  ... and {len(problems) - VERIFY_SHOWN:,} more (--json lists them all)", markup=False)
        out.print(f"{len(report)} artifacts checked, {len(damaged)} damaged")
    if damaged:
        raise typer.Exit(1)


def _existing_store(root: str) -> Store:
    """The store at `root`, or exit 2: verifying a mistyped path must not make an empty store there and report it
    undamaged."""
    from compass.infra.store import STORE_MARKER, Store, root_problem

    missing = "no store here, nothing to verify (give the root a run wrote: how.storage.root or its --store)"
    problem = root_problem(root)
    remote = "://" in root and not root.startswith("file://")
    if problem is None and not remote and not Path(root.removeprefix("file://")).expanduser().is_dir():
        problem = missing
    if problem is None:
        target = Store(root)  # a local root exists by now, so Store makes no folder
        if target.is_marked():
            return target
        problem = missing if remote and not target.fs.exists(target.root_path) else (
            f"not a compass store: no {STORE_MARKER} at its root, which compass writes before a store's first "
            f"artifact; verify acts on compass stores only (give the root a run wrote; a store from a compass before "
            f"this marker: create {root.rstrip('/')}/{STORE_MARKER} once)")
    err.print(f"{root}: {problem}", markup=False, highlight=False, soft_wrap=True)
    raise typer.Exit(EXIT_BAD_INPUT)


def _label(node: dict) -> str:
    """A tree node's text: everything read from manifests is escaped, so a '[/x]' in a path or a name prints as
    written instead of being taken for rich markup (and failing the command)."""
    label = f"[bold]{escape(node['step'])}[/bold] [dim]{escape(node['fingerprint'][:12])}[/dim] {escape(node['uri'])}"
    for p in node.get("provenance", []):
        if "weights_sha256" in p:  # a checkpoint from outside the run (starting point, gate)
            label += escape(f"\n  checkpoint: {p.get('source')} revision {p.get('revision', '-')} "
                            f"weights sha256 {str(p['weights_sha256'])[:16]}")
            continue
        if p.get("kind") == "files":  # a file the spec names, stamped into the step's identity
            try:
                shown = FileStamp.model_validate({k: p.get(k) for k in FileStamp.model_fields}).line()
            except ValueError:  # a manifest edited by hand: its entry as it is
                shown = str(p)
            label += escape(f"\n  files ({p.get('field')}): {shown}")
            continue
        what = p.get("package") or p.get("path") or p.get("uri") or p.get("kind")
        label += escape(f"\n  source: {p.get('kind')} {what} {p.get('version', '')} " + (
            f"sha256 {str(p['archive_sha256'])[:16]}" if "archive_sha256" in p else ""))
    if node.get("missing"):
        label += " [red](missing)[/red]" + (f" [dim]{escape(node['why'])}[/dim]" if node.get("why") else "")
    return label


def _grow(branch: Tree, node: dict, shown: set[str] | None = None) -> None:
    """Each ancestor once: one that several steps share (the curated sources under every tokenization and
    training stage) is printed in full where it first appears, then named with a reference."""
    shown = set() if shown is None else shown
    for child in node.get("inputs", []):
        if child["uri"] in shown:
            branch.add(f"[bold]{escape(child['step'])}[/bold] [dim]{escape(child['fingerprint'][:12])} (shown "
                       "above)[/dim]")
            continue
        shown.add(child["uri"])
        _grow(branch.add(_label(child)), child, shown)


@app.command("evaluate-schedule")
def evaluate_schedule(
        spec: SpecArg,
        root: Annotated[str | None, typer.Option(help="Checkpoint root to scan (default: how.storage.root).")] = None,
        interval: Annotated[int | None, typer.Option(help="Seconds between runs.")] = None,
        cron: Annotated[str | None, typer.Option(help="Cron schedule instead of an interval.")] = None,
        once: Annotated[bool, typer.Option("--once", help="Evaluate now, without a deployment.")] = False,
        as_json: Annotated[bool, typer.Option("--json", help="With --once: the scan's summary as JSON.")] = False
) -> None:
    """Serve a Prefect deployment that evaluates every new checkpoint under a root, on a schedule."""
    checked = load(spec)
    loaded = checked.loaded
    checkpoint_root = store_root(checked, root, "--root")
    if "://" not in checkpoint_root and not Path(checkpoint_root).is_dir():  # a scan would make it: nothing to score
        option = "--root" if root else "how.storage.root"
        err.print(f"{option} {checkpoint_root}: no such folder: name the store a run wrote its checkpoints to "
                  "(its how.storage.root, or the --store it ran with)", markup=False)
        raise typer.Exit(EXIT_BAD_INPUT)
    prepare_environment()
    if once:
        try:
            start_tied_temporary_server()
        except DiskFull as full:  # Prefect's home: nothing scanned
            err.print(f"failed: {spec}: {full.strerror}", markup=False, highlight=False)
            raise typer.Exit(1) from None
    from compass.flows.scheduled_eval import SCAN_ONE_AT_A_TIME, evaluate_new_checkpoints

    benchmarks = [t.model_dump(mode="json") for t in loaded.spec.what.evaluation.benchmarks]
    if not benchmarks:
        err.print(f"{spec}: what.evaluation.benchmarks is empty: nothing to evaluate (add benchmarks to the suite)",
                  markup=False)
        raise typer.Exit(EXIT_BAD_INPUT)
    params = {"checkpoint_root": checkpoint_root, "benchmarks": benchmarks,
              "credentials_block": loaded.spec.how.storage.credentials_block,
              "how": loaded.spec.how.model_dump(mode="json")}  # where and how each evaluation computes
    if once and as_json:
        print(json.dumps(evaluate_new_checkpoints(**params), indent=2))
        return
    if once:  # the scores on the terminal; the libraries' progress bars and warnings in the log
        from compass.flows.scheduled_eval import scan_lines

        log_path = Path(".compass") / "logs" / f"evaluate-{loaded.spec.name}-{time.strftime('%Y%m%d-%H%M%S')}.log"
        err.print(f"everything else the evaluation prints: {log_path}", markup=False, highlight=False)
        with quiet_console(log_path.resolve(), (out, err)):
            summary = evaluate_new_checkpoints(**params)
        for line in scan_lines(summary):
            out.print(line, markup=False, highlight=False, soft_wrap=True)
        return
    ev = loaded.spec.how.evaluation
    interval = interval or (None if cron else ev.schedule_interval_seconds)
    cron = cron or ev.schedule_cron
    if not interval and not cron:
        err.print(f"{spec}: no schedule: pass --interval or --cron, or set how.evaluation.schedule_interval_seconds",
                  markup=False)
        raise typer.Exit(EXIT_BAD_INPUT)
    when = f"every {interval}s" if interval else cron
    out.print(f"serving deployment 'evaluate-{loaded.spec.name}' ({when}) over {params['checkpoint_root']}; "
              "Ctrl-C stops it", markup=False)
    evaluate_new_checkpoints.serve(name=f"evaluate-{loaded.spec.name}", interval=interval, cron=cron,
                                   parameters=params, global_limit=SCAN_ONE_AT_A_TIME)


ablate_app = typer.Typer(help="Ablation helpers.", no_args_is_help=True)
app.add_typer(ablate_app, name="ablate")


@ablate_app.command("promote")
def ablate_promote(
        spec: SpecArg,
        variant: Annotated[str | None, typer.Option(help="Variant to promote (default: the comparison's winner).")]
        = None,
        out_path: Annotated[Path | None, typer.Option("--out", help="New spec file (default: <spec>.promoted.yaml).")]
        = None,
        store: Annotated[str | None, typer.Option(help="Override how.storage.root.")] = None) -> None:
    """Write a new spec whose baseline includes the winning change, and drop that variant."""
    from compass.flows.cli.promote import PromoteError, promote, winning_variant
    from compass.infra.store import Store

    refuse_write_file_option("--out", out_path, "the promoted spec would be written there")
    checked = load(spec)
    target = out_path or spec.with_name(spec.stem + ".promoted.yaml")
    try:
        chosen = variant or winning_variant(checked, Store(store_root(checked, store)))
        change = promote(spec, chosen, target)
    except PromoteError as exc:
        err.print(f"{spec}: {exc}", markup=False)
        raise typer.Exit(EXIT_BAD_INPUT) from None
    except SpecError as exc:
        err.print("\n".join(str(p) for p in exc.problems), markup=False)
        target.unlink(missing_ok=True)
        raise typer.Exit(EXIT_BAD_INPUT) from None
    out.print(f"promoted '{chosen}' ({change}) into {target}", markup=False)


@app.command()
def schema() -> None:
    """Print the spec's JSON Schema (for editor completion and checking)."""

    sys.stdout.write(json.dumps(TrainingSpec.model_json_schema(), indent=2) + "\n")


if __name__ == "__main__":
    app()
