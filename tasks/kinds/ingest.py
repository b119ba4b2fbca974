"""Ingest: turn a raw source (package, local folder, s3 prefix) into datatrove documents (jsonl.gz shards)."""

from __future__ import annotations

import fnmatch
import gzip
import io
import json
import platform
import re
from collections import Counter
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Literal

from compass.infra.errors import DataError, MalformedData
from compass.infra.layout import DOCUMENTS
from compass.infra.packages import fetch_package
from compass.specs.base import Issue
from compass.specs.sources import parse_source_uri
from compass.specs.spec import TrainingSpec
from compass.tasks.steps.context import StepContext, StepResult
from compass.tasks.steps.kind import PlanBuilder, StepConfig, StepKind
from compass.tasks.steps.placement import phase

DOCS_PER_SHARD = 500
# a document is a page, a file, a book: ~1 MB of text at most. A 100 MB single-line "document" (a dump, a
# minified bundle) took 8 GB through curation and is no training document; it is skipped and counted. Files
# and JSONL lines are read with a byte cap derived from the character cap, so memory follows the cap, not the
# input: a longer line or file is skipped without being held whole.
MAX_DOCUMENT_CHARS = 2_000_000
BYTES_PER_CHAR = 8  # UTF-8 takes up to 4 bytes a character, JSON escapes up to 6, HTML markup more
SECTIONED_FILE_FACTOR = 32  # split: sections keeps a whole file in memory to cut it: up to 32 documents' worth
# undecodable bytes replaced by U+FFFD upstream (a mis-declared charset, a binary read as text): above this
# share of a document's characters it is noise, not text
MAX_REPLACEMENT_SHARE = 0.01
MIN_REPLACEMENTS = 4
_BLOCKS = {"p", "div", "pre", "li", "tr", "br", "dt", "dd", "table", "h1", "h2", "h3", "h4", "h5", "h6",
           "blockquote", "section", "title"}
_DROP = ("//script|//style|//nav|//*[contains(@class,'navheader')]|//*[contains(@class,'navfooter')]"
         "|//*[contains(@class,'toc')]")
_SECTION = "\u2063\u2063section\u2063\u2063"  # invisible separators: never in real text


class IngestConfig(StepConfig):
    """Where the raw files are and how they become documents (curation is the next step's)."""

    omit_when_none = frozenset({"python"})

    uri: str
    include: list[str]
    exclude: list[str]
    format: Literal["jsonl", "parquet", "text", "html", "code"]
    text_key: str
    split: Literal["file", "sections"]
    section_chars: int
    language: str | None
    domain: str
    max_documents: int | None
    max_document_chars: int = MAX_DOCUMENT_CHARS
    python: str | None = None  # stdlib:// sources: the standard library differs between Python versions


def build(plan: PlanBuilder) -> None:
    for src in plan.spec.what.data.sources:
        fields = src.model_dump(mode="json", include=set(IngestConfig.model_fields) - {"python"})
        python = platform.python_version() if src.uri.startswith("stdlib://") else None
        plan.add(KIND, src.name, IngestConfig(**fields, python=python))


def check_machine(spec: TrainingSpec, base_dir: Path) -> Iterator[Issue]:
    """A local source must exist on this machine."""
    for i, src in enumerate(spec.what.data.sources):
        uri = parse_source_uri(src.uri)
        if uri.scheme == "file" and not (base_dir / uri.path).expanduser().exists():
            yield Issue(("what", "data", "sources", i, "uri"),
                        f"local source '{uri.path}' does not exist (relative to {base_dir})",
                        "fix the path, or use s3://, deb://, pypi:// or stdlib://")


def run_ingest(ctx: StepContext[IngestConfig]) -> StepResult:
    cfg = ctx.config
    uri = parse_source_uri(cfg.uri)
    provenance: dict
    if uri.scheme == "traces":  # generated: no files to select
        from compass.tasks.post_training.reasoning import trace_documents

        documents, provenance = trace_documents(uri.path, ctx.name, cfg.domain)
        return _write_documents(ctx, documents, [], provenance, {}, Counter())
    if uri.is_package:
        root, provenance = fetch_package(uri)
        if uri.scheme == "stdlib" and uri.path:
            root = root / uri.path
        fs, base = _local_fs(), str(root)
    elif uri.scheme == "s3":
        import fsspec

        fs, base = fsspec.core.url_to_fs(uri.path)
        provenance = {"kind": "s3", "uri": uri.path}
    else:
        path = (ctx.runtime.base_dir / uri.path).expanduser().resolve()
        fs, base = _local_fs(), str(path)
        provenance = {"kind": "local", "path": str(path)}
    files = _select(fs, base.rstrip("/"), cfg.include, cfg.exclude)
    if not files:
        where = cfg.uri if uri.scheme == "s3" else base
        raise DataError(f"source {ctx.name}: no files under {where} match include={cfg.include} "
                         f"exclude={cfg.exclude} (check the URI and the include patterns)")
    ctx.log.info("ingest %s: %d files under %s", ctx.name, len(files), base)
    skipped: dict[str, str] = {}
    dropped: Counter[str] = Counter()
    documents = _documents(fs, base, files, cfg, ctx.name, skipped, dropped)
    return _write_documents(ctx, documents, files, provenance, skipped, dropped)


def _write_documents(ctx: StepContext[IngestConfig], documents: Iterator[dict], files: list[str], provenance: dict,
                     skipped: dict[str, str], dropped: Counter[str]) -> StepResult:
    """Shards of documents (up to max_documents, each under max_document_chars), stats and the step's result."""
    cfg = ctx.config
    docs_dir = ctx.out / DOCUMENTS
    docs_dir.mkdir()
    n_docs = n_chars = 0
    shard: list[str] = []
    shard_id = 0
    limit = cfg.max_documents
    for doc in documents:
        reason = _drop_reason(doc["text"], cfg.max_document_chars)
        if reason:
            dropped[reason] += 1
            continue
        shard.append(json.dumps(doc, ensure_ascii=False))
        n_docs += 1
        n_chars += len(doc["text"])
        if len(shard) == DOCS_PER_SHARD:
            _write_shard(docs_dir, shard_id, shard)
            shard, shard_id = [], shard_id + 1
        if limit and n_docs >= limit:
            break
    if shard:
        _write_shard(docs_dir, shard_id, shard)
    if dropped:
        ctx.log.warning("ingest %s: dropped %s documents (%s characters at most, no NUL, at most %.0f%% U+FFFD)",
                        ctx.name, dict(dropped), f"{cfg.max_document_chars:,}", 100 * MAX_REPLACEMENT_SHARE)
    if skipped:
        ctx.log.warning("ingest %s: skipped %d of %d files that are not text: %s", ctx.name, len(skipped),
                        len(files), "; ".join(f"{k} ({v})" for k, v in list(skipped.items())[:5]))
    if n_docs == 0:
        raise DataError(f"source {ctx.name}: {len(files)} files matched but none held text"
                        + (f" ({len(skipped)} skipped as binary or not UTF-8)" if skipped else "")
                        + (f"; documents dropped: {dict(dropped)} (max_document_chars is {cfg.max_document_chars:,})"
                           if dropped else ""))
    provenance |= {"files": len(files)}
    stats = {"files": len(files), "documents": n_docs, "characters": n_chars, "dropped_documents": dict(dropped),
             "skipped_files": skipped}
    (ctx.out / "stats.json").write_text(json.dumps(stats, indent=2))
    metrics = {"files": len(files), "documents": n_docs, "characters": n_chars, "shards": shard_id + bool(shard),
               "skipped_files": len(skipped), "skipped": dict(list(skipped.items())[:20]),
               "dropped": dict(dropped), "skipped_too_long": dropped["too_long"]}
    summary = (f"### ingest `{ctx.name}`\n\n{cfg.uri} -> {n_docs:,} documents, {n_chars:,} characters "
               f"from {len(files):,} files\n\nprovenance: `{json.dumps(provenance)}`")
    return StepResult(metrics=metrics, summary=summary, provenance=[provenance])


def _local_fs():
    import fsspec

    return fsspec.filesystem("file")


def _select(fs, base: str, include: list[str], exclude: list[str]) -> list[str]:
    found: set[str] = set()
    for pattern in include:
        for path in fs.glob(f"{base}/{pattern}"):
            rel = path[len(base) + 1:]
            if fs.isfile(path) and not any(fnmatch.fnmatch(rel, ex) for ex in exclude):
                found.add(rel)
    return sorted(found)


def _write_shard(folder: Path, shard_id: int, lines: list[str]) -> None:
    with gzip.open(folder / f"{shard_id:05d}.jsonl.gz", "wt", encoding="utf-8", compresslevel=6) as f:
        f.write("\n".join(lines) + "\n")


def _documents(fs, base: str, files: list[str], cfg: IngestConfig, source: str,
               skipped: dict[str, str], dropped: Counter[str]) -> Iterator[dict]:
    """Documents of every file, read as streams with a byte cap; a binary or non-UTF-8 file of a text format is
    skipped (noted in `skipped`), a record file that breaks its format is a MalformedData error naming the file
    and line, a record or file over the cap is dropped unread (counted in `dropped`)."""
    meta = {"source": source, "domain": cfg.domain}
    if cfg.language:
        meta["language"] = cfg.language
    max_bytes = cfg.max_document_chars * BYTES_PER_CHAR
    for rel in files:
        with ExitStack() as stack:
            stream = stack.enter_context(fs.open(f"{base}/{rel}", "rb"))
            if rel.endswith(".gz"):
                stream = stack.enter_context(gzip.GzipFile(fileobj=stream))
            fmt = cfg.format
            if fmt in ("jsonl", "parquet"):
                where = f"{cfg.uri.rstrip('/')}/{rel}"
                records = (_jsonl_records(stream, cfg.text_key, where, max_bytes, dropped) if fmt == "jsonl"
                           else _parquet_records(stream, cfg.text_key, where))
                for i, text in enumerate(records):
                    if text.strip():
                        yield {"id": f"{source}/{rel}#{i}", "text": text, "metadata": {**meta, "path": rel}}
                continue
            cap = max_bytes * (SECTIONED_FILE_FACTOR if cfg.split == "sections" else 1)
            raw = stream.read(cap + 1)
        if len(raw) > cap:
            dropped["too_long"] += 1
            continue
        why = _not_text(raw, strict=fmt != "html")  # lxml decodes HTML by its declared charset
        if why:
            skipped[rel] = why
            continue
        if fmt == "html":
            parts = _html_sections(raw) if cfg.split == "sections" else [_html_text(raw)]
        elif fmt == "text" and cfg.split == "sections":
            parts = re.split(r"\n\s*\n", raw.decode("utf-8"))
        else:
            parts = [raw.decode("utf-8")]
        if cfg.split == "sections":
            parts = _group(parts, cfg.section_chars)
        for i, part in enumerate(p for p in parts if p.strip()):
            yield {"id": f"{source}/{rel}#{i}", "text": part.strip(), "metadata": {**meta, "path": rel}}


def _drop_reason(text: str, max_chars: int) -> str:
    """Why a decoded document is no training text ('' when it is)."""
    if len(text) > max_chars:
        return "too_long"
    if "\0" in text:
        return "nul_bytes"
    replaced = text.count("\ufffd")
    if replaced >= MIN_REPLACEMENTS and replaced > MAX_REPLACEMENT_SHARE * len(text):
        return "replacement_characters"
    return ""


def _not_text(raw: bytes, strict: bool) -> str:
    """Why these bytes are not a text document ('' when they are): NUL bytes mean a binary file; a strict
    format must also be valid UTF-8 (replacing what does not decode turned a binary into 8,000 U+FFFD)."""
    if b"\0" in raw[:8192]:
        return "binary: NUL bytes"
    if strict:
        try:
            raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            return f"not UTF-8: byte 0x{raw[exc.start]:02x} at offset {exc.start}"
    return ""


def _bounded_lines(stream, max_bytes: int) -> Iterator[tuple[int, bytes | None]]:
    """(line number, line) of a byte stream; a line longer than `max_bytes` comes as None, read past in 1 MiB
    pieces and never held whole."""
    number = 0
    while line := stream.readline(max_bytes + 1):
        number += 1
        if len(line) > max_bytes and not line.endswith(b"\n"):
            while (rest := stream.readline(1 << 20)) and not rest.endswith(b"\n"):
                pass
            yield number, None
            continue
        yield number, line


def _jsonl_records(stream, key: str, where: str, max_bytes: int, dropped: Counter[str]) -> Iterator[str]:
    for number, line in _bounded_lines(stream, max_bytes):
        if line is None:
            dropped["too_long"] += 1
            continue
        line = line.rstrip(b"\r\n")
        if not line.strip():
            continue
        try:
            record = json.loads(line.decode("utf-8"))
        except UnicodeDecodeError as exc:
            raise MalformedData(f"{where}:{number}: not UTF-8 (byte 0x{line[exc.start]:02x} at column "
                                f"{exc.start + 1})") from None
        except json.JSONDecodeError as exc:
            raise MalformedData(f"{where}:{number}: not a JSON record: {exc.msg} at column {exc.colno}") from None
        if not isinstance(record, dict):
            raise MalformedData(f"{where}:{number}: a JSON {type(record).__name__}, not an object with '{key}'")
        yield str(record.get(key, ""))


def _parquet_records(stream, key: str, where: str) -> Iterator[str]:
    """Row group by row group: memory follows the file's row groups, not its size."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        if not stream.seekable():  # a .parquet.gz
            stream = io.BytesIO(stream.read())
        batches = pq.ParquetFile(stream).iter_batches(columns=[key], batch_size=1024)
        for batch in batches:
            yield from (str(v) for v in batch.column(0).to_pylist())
    except (pa.ArrowInvalid, KeyError, ValueError) as exc:
        raise MalformedData(f"{where}: not a parquet file with a '{key}' column ({exc})") from None


def _html_tree(raw: bytes):
    import lxml.html

    tree = lxml.html.fromstring(raw)
    for el in tree.xpath(_DROP):
        el.drop_tree()
    for el in tree.iter():
        if isinstance(el.tag, str) and el.tag in _BLOCKS:
            el.tail = "\n" + (el.tail or "")
    return tree


def _clean(text: str) -> str:
    text = re.sub(r"[ \t\r\f\v]+", " ", text)
    return re.sub(r"\n\s*\n\s*", "\n\n", text).strip()


def _html_text(raw: bytes) -> str:
    return _clean(_html_tree(raw).text_content())


def _html_sections(raw: bytes) -> list[str]:
    tree = _html_tree(raw)
    for heading in tree.xpath("//h1|//h2|//h3"):
        heading.text = _SECTION + (heading.text or "")
    return [_clean(part) for part in tree.text_content().split(_SECTION)]


def _group(parts: list[str], target: int) -> list[str]:
    """Merge consecutive small sections until each document holds about `target` characters."""
    out: list[str] = []
    current = ""
    for part in parts:
        part = part.strip()
        if not part:
            continue
        current = f"{current}\n\n{part}" if current else part
        if len(current) >= target:
            out.append(current)
            current = ""
    if current:
        out.append(current)
    return out


# 2: binary and non-UTF-8 files are skipped (they were decoded with U+FFFD replacements)
# 3: records with NUL bytes or mostly U+FFFD are dropped; files and lines are read with a byte cap
KIND = StepKind("ingest", IngestConfig, run_ingest, build, version="3", resources=phase("data"), tags=("data",),
                check_machine=check_machine)
STEP_KINDS = (KIND,)
