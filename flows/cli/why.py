"""`compass why STEP SPEC`: why one step of a spec's plan would run or is reused, field by field, and for a step
that runs because an input changed, why that input runs, down to the fields that started it."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Annotated

import typer

from compass.flows.cli.common import (
    EXIT_BAD_INPUT,
    MachineChecksOption,
    SmokeOption,
    SpecArg,
    err,
    load,
    out,
    store_root,
)


@dataclass(frozen=True)
class Because:
    """One step's answer: its state (run, cached, unknown), the reason, and the answers for the inputs it names."""

    step: str
    state: str
    reason: str
    artifact: str
    inputs: tuple[Because, ...] = ()


def why(step: Annotated[str, typer.Argument(help="A step id (pretrain:stage1), or a kind with one step.",
                                            show_default=False)],
        spec: SpecArg,
        store: Annotated[str | None, typer.Option(help="Override how.storage.root.")] = None,
        as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output.")] = False,
        smoke: SmokeOption = False,
        machine_checks: MachineChecksOption = True) -> None:
    """Why a step would run (which config or how field changed, old -> new; which input, and why that input
    runs; or the kind's code version) or is reused (its artifact, and the placement it was made under where that
    differs from the spec's now). Reads the store only."""
    from compass.flows.reports.plan_status import plan_status
    from compass.infra.store import Store

    checked = load(spec, smoke=smoke, machine=machine_checks)
    plan = checked.plan
    matches = [s.id for s in plan.steps if step in (s.id, s.kind)]
    if len(matches) != 1:
        some = ", ".join(s.id for s in plan.steps[:8])
        err.print(f"{step}: {'several steps match' if matches else 'no step of this plan matches'} "
                  f"({', '.join(matches) if matches else some + ', ...'}): name one step id", markup=False)
        raise typer.Exit(EXIT_BAD_INPUT)
    target = Store(store_root(checked, store), create=False)
    statuses = {s.step_id: s for s in plan_status(plan, target)}
    root = target.root.rstrip("/") + "/"

    answered: dict[str, Because] = {}

    def answer(step_id: str) -> Because:  # each step's once: a DAG's shared inputs are not walked again
        if step_id not in answered:
            status = statuses[step_id]
            answered[step_id] = Because(step_id, status.state, status.reason, status.uri.removeprefix(root),
                                        tuple(answer(dep) for dep in status.changed_inputs))
        return answered[step_id]

    found = answer(matches[0])
    if as_json:
        print(json.dumps(asdict(found), indent=2))
        return
    for line in lines(found):
        out.print(line, markup=False, highlight=False)


def lines(found: Because, depth: int = 0, said: set[str] | None = None) -> list[str]:
    """The answer as indented lines, each step's once: an input two steps share (the tokenizer of every tokenized
    source) is explained where it first comes, and not again under the others."""
    said = set() if said is None else said
    said.add(found.step)
    verb = {"run": "runs", "cached": "is reused", "unknown": "is unknown"}.get(found.state, found.state)
    where = f" ({found.artifact})" if found.state == "cached" else ""
    out_lines = [f"{'  ' * depth}{found.step} {verb}{where}: {found.reason}"]
    for dep in found.inputs:
        if dep.step not in said:
            out_lines += lines(dep, depth + 1, said)
    return out_lines



