"""Edits of a YAML file made in its text, at the places a round-trip parse locates: a value replaced where it is
written, an item or a section cut out by its lines. Every other byte of the file stays as the person wrote it
(spacing inside a line, quotes, comments, blank lines), which a load-and-dump cannot promise: `compass ablate
promote` must change exactly the promoted line."""

from __future__ import annotations

import io
from typing import Any

from ruamel.yaml import YAML

CLOSING = {"{": "}", "[": "]"}


def flow_text(value: Any) -> str:
    """`value` as YAML on one line (flow style for a mapping or a list)."""
    yaml = YAML(typ="rt")
    yaml.default_flow_style = True
    yaml.width = 1 << 16
    buffer = io.StringIO()
    yaml.dump([value], buffer)
    text = buffer.getvalue().strip()
    return text[1:-1]  # the one-item list's brackets


def value_end(line: str, col: int, in_flow: bool) -> int:
    """Where the value starting at `col` of `line` ends: its closing bracket or quote, or a plain scalar's end
    (before a comment, or before `,` `}` `]` inside a flow collection)."""
    opening = line[col] if col < len(line) else ""
    if opening in CLOSING:
        depth, quote = 0, ""
        for i in range(col, len(line)):
            c = line[i]
            if quote:
                quote = "" if c == quote else quote
            elif c in "\"'":
                quote = c
            elif c in "{[":
                depth += 1
            elif c in "}]":
                depth -= 1
                if depth == 0:
                    return i + 1
        raise ValueError("a flow collection that continues on the next line")
    if opening in "\"'":
        end = line.find(opening, col + 1)
        while opening == "'" and end != -1 and line[end + 1: end + 2] == "'":  # '' is a quote inside
            end = line.find("'", end + 2)
        if end == -1:
            raise ValueError("a quoted string that continues on the next line")
        return end + 1
    end = len(line.rstrip("\n"))
    comment = line.find(" #", col)
    if comment != -1:
        end = comment
    if in_flow:
        for stop in ",}]":
            at = line.find(stop, col)
            if at != -1:
                end = min(end, at)
    return len(line[:end].rstrip())


def replaced(line: str, col: int, in_flow: bool, new: str) -> str:
    """`line` with the value at `col` replaced by `new`; a comment after it keeps its column where it can."""
    end = value_end(line, col, in_flow)
    rest = line[end:]
    if not in_flow and rest.lstrip().startswith("#"):
        comment_col = end + len(rest) - len(rest.lstrip())
        pad = max(1, comment_col - (col + len(new)))
        return line[:col] + new + " " * pad + rest.lstrip()
    return line[:col] + new + rest


def block_end(lines: list[str], start: int, indent: int) -> int:
    """The index after the last line of the block that starts at line `start`: the lines after it that are blank,
    or indented deeper than `indent`, up to the first line at `indent` or less (comments at `indent` or less and
    the blank lines before them stay with what follows)."""
    end = start + 1
    last = start
    while end < len(lines):
        text = lines[end]
        stripped = text.strip()
        depth = len(text) - len(text.lstrip())
        if stripped and depth <= indent:
            break
        if stripped:
            last = end
        end += 1
    return last + 1
