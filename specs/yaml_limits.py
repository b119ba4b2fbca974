"""Limits a spec's YAML must keep before compass builds anything from it.

A spec is a few kilobytes. A hostile or broken one (an alias bomb, 10,000 levels of nesting, a `!!python/...`
tag, a 5,000-digit integer, 50 MB of keys) must be refused in milliseconds with the line to fix, not after it
has grown to gigabytes or ended in a traceback. The limits are checked on the loader's own parse: each event is
counted as the composer takes it (events never expand aliases, never recurse, never construct an object), so a
document the checks cannot read is one the loader cannot read either, and fails with its line; there is no
second parser whose errors could switch the limits off.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from ruamel.yaml import YAML
from ruamel.yaml.constructor import ConstructorError, RoundTripConstructor
from ruamel.yaml.error import YAMLError
from ruamel.yaml.events import (
    AliasEvent,
    CollectionEndEvent,
    CollectionStartEvent,
    NodeEvent,
    ScalarEvent,
)
from ruamel.yaml.nodes import ScalarNode
from ruamel.yaml.parser import RoundTripParser
from ruamel.yaml.scanner import RoundTripScanner
from ruamel.yaml.tokens import DirectiveToken

MAX_BYTES = 1 << 20  # override with COMPASS_MAX_SPEC_BYTES
MAX_DEPTH = 32  # the schema nests 7 levels; lists of mappings add a few
MAX_NODES = 10_000  # after expanding aliases; the largest example spec has ~700
MAX_SCALAR = 10_000  # characters in one value (a description, a prompt)
MAX_LINE = 100_000  # characters in one line, checked before parsing: the pure-Python scanner reads ~1 MB a second
MAX_DIGITS = 30  # an integer with more digits is no count, size or seed compass uses
YAML_VERSIONS = ((1, 1), (1, 2))  # what ruamel reads; any other %YAML directive is refused, not asserted on
INT_TAG = "tag:yaml.org,2002:int"
STANDARD_TAGS = frozenset(f"tag:yaml.org,2002:{t}" for t in
                          ("str", "int", "float", "bool", "null", "map", "seq", "binary", "timestamp"))


@dataclass(frozen=True)
class LimitExceeded:
    """Where the document broke a limit (0-based line), what, and how to fix it."""

    line: int
    message: str
    hint: str


class LimitError(YAMLError):
    """Raised from inside the parse at the first limit broken, so nothing past it is parsed or built."""

    def __init__(self, problem: LimitExceeded):
        super().__init__(problem.message)
        self.problem = problem


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


def load(text: str) -> Any:
    """The round-trip document (comments and line numbers kept), parsed once under the limits.

    Raises LimitError at the first limit broken, or ruamel's MarkedYAMLError (with its line) for bad YAML."""
    problem = _long_line(text)
    if problem:
        raise LimitError(problem)
    yaml = YAML(typ="rt")
    yaml.Scanner, yaml.Parser, yaml.Constructor = _Scanner, _LimitedParser, _Constructor
    yaml.allow_duplicate_keys = False
    return yaml.load(text)


def _long_line(text: str) -> LimitExceeded | None:
    """A line no spec has, refused at once rather than after the scanner has read it character by character.
    A comment line is left to the parser: it holds no value (and one inside a block scalar is a value the
    scalar limit refuses)."""
    if len(text) <= MAX_LINE:
        return None
    for number, line in enumerate(text.split("\n")):
        if len(line) > MAX_LINE and not line.lstrip().startswith("#"):
            return LimitExceeded(number, f"a line of {len(line):,} characters (the limit is {MAX_LINE:,})",
                                 "keep long texts in files the spec names")
    return None


@dataclass
class _Counter:
    """What the document would become, counted one event at a time in the order the composer takes them."""

    depth: int = 0
    nodes: int = 0
    anchored: dict[str, int] = field(default_factory=dict)  # anchor -> nodes its value expands to
    open_anchors: list[tuple[str | None, int]] = field(default_factory=list)  # per open collection

    def check(self, event: Any, resolver: Any) -> LimitExceeded | None:
        line = event.start_mark.line if event.start_mark else 0
        problem = None
        if isinstance(event, AliasEvent):
            self.nodes += self.anchored.get(event.anchor, 1)
        elif isinstance(event, NodeEvent):
            problem = self._node(event, line, resolver)
        elif isinstance(event, CollectionEndEvent):
            self.depth -= 1
            anchor, start = self.open_anchors.pop()
            if anchor:
                self.anchored[anchor] = self.nodes - start + 1
        if problem is None and self.nodes > MAX_NODES:
            problem = LimitExceeded(line, f"the spec expands to more than {MAX_NODES:,} values (aliases included)",
                                    "a spec has hundreds of values: check anchors and aliases (*name) that repeat "
                                    "large blocks")
        return problem

    def _node(self, event: NodeEvent, line: int, resolver: Any) -> LimitExceeded | None:
        self.nodes += 1
        tag = _tag(event)
        if tag is not None and tag not in STANDARD_TAGS and not (tag == "!" and isinstance(event, ScalarEvent)):
            return LimitExceeded(line, f"YAML tag {tag} is not allowed in a spec",
                                 "remove the tag: a spec holds plain mappings, lists, strings and numbers")
        if isinstance(event, ScalarEvent):
            if event.anchor:
                self.anchored[event.anchor] = 1
            return _scalar(event, line, resolver)
        if isinstance(event, CollectionStartEvent):
            self.depth += 1
            if self.depth > MAX_DEPTH:
                return LimitExceeded(line, f"the spec nests deeper than {MAX_DEPTH} levels",
                                     "a spec's sections nest a few levels: check the indentation")
            self.open_anchors.append((event.anchor, self.nodes))
        return None


def _tag(event: NodeEvent) -> str | None:
    tag = getattr(event.tag, "value", event.tag)
    return None if tag is None else str(tag)


def _scalar(event: ScalarEvent, line: int, resolver: Any) -> LimitExceeded | None:
    value = event.value or ""
    if len(value) > MAX_SCALAR:
        return LimitExceeded(line, f"a value of {len(value):,} characters (the limit is {MAX_SCALAR:,})",
                             "keep long texts in files the spec names")
    digits = len(value.lstrip("+-").replace("_", ""))
    if digits > MAX_DIGITS and _is_int(event, resolver):
        return LimitExceeded(line, f"an integer of {digits} digits",
                             "counts, sizes and seeds fit in a few digits: check the value")
    return None


def _is_int(event: ScalarEvent, resolver: Any) -> bool:
    """Whether the composer will make this scalar an integer: the resolver that decides it there decides it here."""
    tag = _tag(event)
    if tag is None and event.implicit and event.implicit[0]:
        tag = str(resolver.resolve(ScalarNode, event.value, event.implicit))
    return tag == INT_TAG


class _LimitedParser(RoundTripParser):
    """ruamel's round-trip parser, checking each event against the limits as the composer takes it."""

    def reset_parser(self) -> None:
        super().reset_parser()
        self._counter = _Counter()

    def get_event(self) -> Any:
        event = super().get_event()
        problem = self._counter.check(event, self.resolver)
        if problem:
            raise LimitError(problem)
        return event


class _Scanner(RoundTripScanner):
    """Refuses a %YAML version ruamel cannot read with its line (ruamel itself fails an assertion on it)."""

    def get_token(self) -> Any:
        token = super().get_token()
        if isinstance(token, DirectiveToken) and token.name == "YAML" and tuple(token.value) not in YAML_VERSIONS:
            major, minor = token.value
            raise LimitError(LimitExceeded(token.start_mark.line, f"%YAML {major}.{minor} is not supported",
                                           "remove the %YAML line: specs are YAML 1.2"))
        return token


class _Constructor(RoundTripConstructor):
    """Turns a value that fails to build (`2001-02-30`, `!!int abc`, `!!bool maybe`) into an error at its line."""

    def construct_non_recursive_object(self, node: Any, tag: str | None = None) -> Any:
        try:
            return super().construct_non_recursive_object(node, tag)
        except (ValueError, KeyError, TypeError, OverflowError) as exc:
            what = f"{node.value!r} as {node.tag}" if isinstance(node, ScalarNode) else f"a {node.tag} value"
            raise ConstructorError(None, None, f"cannot read {what}: {exc}", node.start_mark) from None
