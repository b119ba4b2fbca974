"""The command line's reference page, written from the commands themselves (their click tree): every command, its
arguments and options with their help and defaults. The docs site generates it at every build
(docs/hooks/spec_reference.py), so the page cannot drift from `compass --help`."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import typer.main

from compass.flows.cli.app import app


def commands(group: Any, prefix: str = "compass") -> Iterator[tuple[str, Any]]:
    """Every command under `group` (typer's click group: typer carries its own click, so this reads the tree by
    its attributes), by its full name (`compass ablate promote`), in the order --help lists them."""
    for name, command in group.commands.items():
        if command.hidden:
            continue
        if hasattr(command, "commands"):
            yield from commands(command, f"{prefix} {name}")
        else:
            yield f"{prefix} {name}", command


def _cell(text: str | None) -> str:
    return " ".join((text or "").split()).replace("|", "\\|").replace("<", "&lt;").replace(">", "&gt;")


def _option(param: Any) -> tuple[str, str, str]:
    names = " / ".join([*param.opts, *param.secondary_opts])
    default = param.default
    shown = "" if default is None or default is False or param.required else f"`{default}`"
    return f"`{names}`", _cell(getattr(param, "help", "") or ""), shown


def render() -> str:
    """The page: one section per command, its help, then a table of its arguments and options."""


    lines = ["# Command line", "",
             "Generated from the commands themselves at every build of this site (`compass COMMAND --help` says the "
             "same).", ""]
    for name, command in commands(typer.main.get_command(app)):
        lines += [f"## `{name}`", "", _cell(command.help), ""]
        rows = [(f"`{p.name.upper()}`", _cell(getattr(p, "help", "")), "" if p.required else f"`{p.default}`")
                for p in command.params if p.param_type_name == "argument"]
        rows += [_option(p) for p in command.params if p.param_type_name == "option"]
        if rows:
            lines += ["| argument or option | what | default |", "| --- | --- | --- |"]
            lines += [f"| {name} | {what} | {default} |" for name, what, default in rows]
            lines.append("")
    return "\n".join(lines)
