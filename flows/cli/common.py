"""What every `compass` command shares: the consoles, the exit code for bad input, and loading a spec with every
check (schema, rules, machine checks) so that a bad spec stops here with all its problems and nothing written."""

from __future__ import annotations

import os
import sys
import unicodedata
from collections.abc import Iterable
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.markup import escape
from rich.segment import Segment

from compass.flows.compiler import UnknownTarget
from compass.flows.validation import CheckedSpec, load_checked
from compass.specs.base import Issue
from compass.specs.how import system_folder_problem, write_root_problem
from compass.specs.loader import SpecError
from compass.specs.smoke import Size, sized_root
from compass.specs.sources import source_holding


def visible(text: str) -> str:
    """Control characters (an escape sequence in a spec value or a file name) shown as `\x1b`, never sent raw."""
    if text.isprintable():  # the common case, checked in C
        return text
    return "".join(f"\\x{ord(c):02x}" if unicodedata.category(c) == "Cc" and c not in "\n\t" else c for c in text)


class SafeConsole(Console):
    """A console that never lets what it prints drive the terminal: control characters in the text are escaped
    (rich's own cursor controls, for live displays, pass) and `:name:` stays text, not an emoji."""

    def __init__(self, **kwargs):
        super().__init__(emoji=False, **kwargs)

    def _render_buffer(self, buffer: Iterable[Segment]) -> str:
        return super()._render_buffer(segment if segment.control else Segment(visible(segment.text), segment.style)
                                      for segment in buffer)


# Piped output (logs, CI, scripts) keeps each message on one line: tables render 200 wide, text never wraps.
out = SafeConsole(width=None if sys.stdout.isatty() else 200, soft_wrap=not sys.stdout.isatty())
err = SafeConsole(stderr=True, width=None if sys.stderr.isatty() else 200, soft_wrap=not sys.stderr.isatty())

SpecArg = Annotated[Path, typer.Argument(help="Training spec (YAML).", show_default=False)]
SmokeOption = Annotated[bool, typer.Option(
    "--smoke", help="The same DAG with every size shrunk to run on this CPU in minutes, in its own store "
                    "(<root>-smoke); ends with what each step exercised and what was shrunk.")]
MachineChecksOption = Annotated[bool, typer.Option(
    help="Check this machine too (Slurm, GPUs and their extras, memory per device, S3 credentials, local paths, the "
         "Hugging Face cache); --no-machine-checks checks the spec alone, e.g. a cluster's spec from a laptop.")]
RehearseOption = Annotated[bool, typer.Option(
    "--rehearse", help="The production launch at toy size, the first thing to run on a new cluster: `what` shrunk as "
                       "--smoke does, `how` kept (accelerator, engine, ZeRO stage, TP, precision, kernels, Slurm "
                       "launch, requeue, probe, staging, per-phase shapes; nodes and GPUs per node capped at 2), in "
                       "its own store (<root>-rehearsal); ends with what each step exercised and what was shrunk.")]
EXIT_BAD_INPUT = 2


def size_of(path: Path, smoke: bool, rehearse: bool) -> Size:
    """The size `--smoke` or `--rehearse` asks for; both at once is bad input (exit 2)."""
    if smoke and rehearse:
        err.print(f"{path}: --smoke and --rehearse exclude each other: --smoke runs on this CPU without `how`'s "
                  "cluster, --rehearse keeps it", markup=False, highlight=False)
        raise typer.Exit(EXIT_BAD_INPUT)
    return "smoke" if smoke else "rehearsal" if rehearse else "full"


def load(path: Path, until: list[str] | None = None, smoke: bool = False, machine: bool = True,
         rehearse: bool = False) -> CheckedSpec:
    """The checked spec and its plan, or exit 2 with every problem; `until` names must match steps of the plan.
    `smoke`, `rehearse`: at smoke or rehearsal size; `machine=False`: without the checks of this machine (planning
    for another one)."""

    size = size_of(path, smoke, rehearse)
    try:
        checked = load_checked(path, machine=machine, size=size)
    except SpecError as exc:
        for problem in exc.problems:
            err.print(str(problem), markup=False, highlight=False)
        n = len(exc.problems)
        err.print(f"[red]{n} problem{'s' if n != 1 else ''} in {escape(str(path))}[/red]; nothing was run or "
                  "written.")
        raise typer.Exit(EXIT_BAD_INPUT) from None
    if until:
        try:
            checked.plan.up_to(until)
        except UnknownTarget as exc:
            err.print(f"{path}: {exc}", markup=False, highlight=False)
            raise typer.Exit(EXIT_BAD_INPUT) from None
    return checked


def _inside_a_source(checked: CheckedSpec, root: str) -> str | None:
    """A store inside a local source folder (specs/sources.py `source_holding`)."""

    holder = source_holding(checked.spec.what.data.sources, checked.loaded.base_dir, root)
    if holder is None:
        return None
    store = Path(root.removeprefix("file://")).expanduser().resolve()
    return f"the store {store} lies inside the local source '{holder[0]}' ({holder[1]}): put it outside the folder"


def store_root(checked: CheckedSpec, store: str | None, option: str = "--store") -> str:
    """`--store` if given (relative to the working directory), else the spec's `how.storage.root` (relative to the
    spec's folder: Storage.root_at); a smoke run or a rehearsal writes beside it, to `<root>-smoke` or
    `<root>-rehearsal`, never among real artifacts. Exit 2 when it cannot hold a store."""
    from compass.infra.store import root_problem

    given = store
    if store and checked.loaded.size != "full":
        store = sized_root(store, checked.loaded.size)
    root = store or checked.spec.how.storage.root_at(checked.loaded.base_dir)
    # the root as given too: `--store / --smoke` must not become `<cwd>/-smoke`
    problem = (given and root_problem(given)) or root_problem(root) or _inside_a_source(checked, root)
    if problem is None:
        return root
    if store:
        err.print(f"{option} {given}: {problem}", markup=False, highlight=False, soft_wrap=True)
    else:

        (located,) = checked.loaded.problems([Issue(("how", "storage", "root"), problem, "set another root")])
        err.print(str(located), markup=False, highlight=False)
    raise typer.Exit(EXIT_BAD_INPUT)


def refuse_write_option(option: str, value: str | Path | None, what: str) -> None:
    """Exit 2, before anything is written, when the folder a command writes under by `option` breaks the write
    rule (specs/how.write_root_problem: system folders, the root, folders that hold others', by any form)."""
    folder = _without_file_scheme(value)
    if folder is not None and "://" not in folder and (problem := write_root_problem(folder, what)):
        err.print(f"{option} {value}: {problem}", markup=False, highlight=False, soft_wrap=True)
        raise typer.Exit(EXIT_BAD_INPUT)


def refuse_write_file_option(option: str, value: Path | None, what: str) -> None:
    """Exit 2 when the file a command writes by `option` would land in a system folder (by any form)."""
    if (given := _without_file_scheme(value)) is not None:
        folder = str(Path(os.path.realpath(os.path.expanduser(given))).parent)
        if problem := system_folder_problem(folder, what):
            err.print(f"{option} {value}: {problem}", markup=False, highlight=False, soft_wrap=True)
            raise typer.Exit(EXIT_BAD_INPUT)


def _without_file_scheme(value: str | Path | None) -> str | None:
    """The local path a `file:` URI names (a Path option turns `file:///x` into `file:/x`); other values as given."""
    if value is None:
        return None
    text = str(value)
    return "/" + text[5:].lstrip("/") if text.startswith("file:") else text
