"""Limits a spec's YAML must keep before compass builds anything from it.

A spec is a few kilobytes. A hostile or broken one (an alias bomb, 10,000 levels of nesting, a `!!python/...`
tag, a 5,000-digit integer, 50 MB of keys) must be refused in milliseconds with the line to fix, not after it
has grown to gigabytes or ended in a traceback. The check reads YAML's event stream once, which never expands
aliases, never recurses and never constructs an object, and counts what the document would become.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from ruamel.yaml import YAML
from ruamel.yaml.error import YAMLError
from ruamel.yaml.events import (
    AliasEvent,
    CollectionEndEvent,
    CollectionStartEvent,
    NodeEvent,
    ScalarEvent,
)

MAX_BYTES = 1 << 20  # override with COMPASS_MAX_SPEC_BYTES
MAX_DEPTH = 32  # the schema nests 7 levels; lists of mappings add a few
MAX_NODES = 10_000  # after expanding aliases; the largest example spec has ~700
MAX_SCALAR = 10_000  # characters in one value (a description, a prompt)
MAX_DIGITS = 30  # an integer with more digits is no count, size or seed compass uses
STANDARD_TAGS = frozenset(f"tag:yaml.org,2002:{t}" for t in
                          ("str", "int", "float", "bool", "null", "map", "seq", "binary", "timestamp"))


@dataclass(frozen=True)
class LimitExceeded:
    """Where the document broke a limit (0-based line), what, and how to fix it."""

    line: int
    message: str
    hint: str


def max_bytes() -> int:
    value = os.environ.get("COMPASS_MAX_SPEC_BYTES", "")
    return int(value) if value.isdigit() else MAX_BYTES


def size_problem(size: int) -> LimitExceeded | None:
    limit = max_bytes()
    if size <= limit:
        return None
    return LimitExceeded(0, f"the spec is {size:,} bytes, more than the limit of {limit:,}",
                         "a training spec is a few kilobytes: move long texts into files it names, or raise "
                         "COMPASS_MAX_SPEC_BYTES")


def scan(text: str) -> LimitExceeded | None:
    """The first limit the document breaks, or None. YAML syntax errors are left to the parser that follows."""
    depth = 0
    nodes = 0
    anchored: dict[str, int] = {}  # anchor -> nodes its value expands to
    open_anchors: list[tuple[str | None, int]] = []  # per open collection: its anchor, the node count at its start
    try:
        for event in YAML(typ="safe", pure=False).parse(text):  # libyaml: ~50x the pure parser
            line = event.start_mark.line if event.start_mark else 0
            if isinstance(event, AliasEvent):
                nodes += anchored.get(event.anchor, 1)
            elif isinstance(event, NodeEvent):
                nodes += 1
                tag = getattr(event.tag, "value", event.tag)
                if tag is not None and str(tag) not in STANDARD_TAGS and not _plain_non_specific(event, tag):
                    return LimitExceeded(line, f"YAML tag {tag} is not allowed in a spec",
                                         "remove the tag: a spec holds plain mappings, lists, strings and numbers")
                if isinstance(event, ScalarEvent):
                    problem = _scalar(event, line)
                    if problem:
                        return problem
                    if event.anchor:
                        anchored[event.anchor] = 1
                if isinstance(event, CollectionStartEvent):
                    depth += 1
                    if depth > MAX_DEPTH:
                        return LimitExceeded(line, f"the spec nests deeper than {MAX_DEPTH} levels",
                                             "a spec's sections nest a few levels: check the indentation")
                    open_anchors.append((event.anchor, nodes))
            elif isinstance(event, CollectionEndEvent):
                depth -= 1
                anchor, start = open_anchors.pop()
                if anchor:
                    anchored[anchor] = nodes - start + 1
            if nodes > MAX_NODES:
                return LimitExceeded(line, f"the spec expands to more than {MAX_NODES:,} values (aliases "
                                     "included)", "a spec has hundreds of values: check anchors and aliases "
                                     "(*name) that repeat large blocks")
    except YAMLError:
        return None
    return None


def _plain_non_specific(event: NodeEvent, tag: object) -> bool:
    return str(tag) == "!" and isinstance(event, ScalarEvent)


def _scalar(event: ScalarEvent, line: int) -> LimitExceeded | None:
    value = event.value or ""
    if len(value) > MAX_SCALAR:
        return LimitExceeded(line, f"a value of {len(value):,} characters (the limit is {MAX_SCALAR:,})",
                             "keep long texts in files the spec names")
    if not event.style and len(value.lstrip("+-").replace("_", "")) > MAX_DIGITS and \
            value.lstrip("+-").replace("_", "").isdigit():
        return LimitExceeded(line, f"an integer of {len(value)} digits",
                             "counts, sizes and seeds fit in a few digits: check the value")
    return None
