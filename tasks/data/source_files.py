"""The texts of a raw source's files (a package, a local folder, an s3:// prefix), read as streams: formats compass
reads that datatrove's readers do not (HTML pages cut into sections, whole text and code files) and the checks a
raw source needs (byte caps, binary and non-UTF-8 files skipped and named, broken records named with file and
line). No datatrove here: the ingest kind imports it where the orchestrator loads the registry; the reader block
that runs it in datatrove's tasks is tasks/data/source_reader.py."""

from __future__ import annotations

import gzip
import io
import json
import re
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Literal

import lxml.html
import orjson
from fsspec.spec import AbstractBufferedFile

from compass.infra.errors import MalformedData

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


@dataclass(frozen=True)
class ReadSettings:
    """How a source's files become documents (the ingest step's config, as the reader needs it)."""

    source: str
    uri: str
    format: Literal["jsonl", "parquet", "text", "html", "code", "warc"]
    text_key: str
    split: Literal["file", "sections"]
    section_chars: int
    domain: str
    language: str | None
    max_document_chars: int


def file_texts(fs, rel: str, s: ReadSettings, skipped: dict[str, str], dropped: dict[str, int]) -> Iterator[str]:
    """The texts of one file, numbered as the file holds them (a record's index, a section's), read as a stream
    with a byte cap; empty texts are left out but keep their number. A binary or non-UTF-8 file of a text format
    is skipped (noted in `skipped`), a record file that breaks its format is a MalformedData error naming the
    file and line, a record or file over the cap is dropped unread (counted in `dropped['too_long']`)."""
    max_bytes = s.max_document_chars * BYTES_PER_CHAR
    with opened(fs, rel) as stream:
        if s.format in ("jsonl", "parquet"):
            where = f"{s.uri.rstrip('/')}/{rel}"
            records = (_jsonl_records(stream, s.text_key, where, max_bytes, dropped) if s.format == "jsonl"
                       else _parquet_records(stream, s.text_key, where))
            yield from (text if text.strip() else "" for text in records)
            return
        cap = max_bytes * (SECTIONED_FILE_FACTOR if s.split == "sections" else 1)
        raw = stream.read(cap + 1)
    if len(raw) > cap:
        dropped["too_long"] = dropped.get("too_long", 0) + 1
        return
    why = _not_text(raw, strict=s.format != "html")  # lxml decodes HTML by its declared charset
    if why:
        skipped[rel] = why
        return
    if s.format == "html":
        parts = _html_sections(raw) if s.split == "sections" else [html_text(raw)]
    elif s.format == "text" and s.split == "sections":
        parts = re.split(r"\n\s*\n", raw.decode("utf-8"))
    else:
        parts = [raw.decode("utf-8")]
    if s.split == "sections":
        parts = _group(parts, s.section_chars)
    yield from (p.strip() for p in parts if p.strip())


@contextmanager
def opened(fs, rel: str) -> Iterator[io.BufferedIOBase]:
    """One of a source's files as a byte stream: buffered when an object store holds it (its readline takes no
    size cap), decompressed when it is gzipped."""
    with ExitStack() as stack:
        stream = stack.enter_context(fs.open(rel, "rb"))
        if isinstance(stream, AbstractBufferedFile):
            stream = stack.enter_context(io.BufferedReader(stream, buffer_size=1 << 20))
        if rel.endswith(".gz"):
            stream = stack.enter_context(gzip.GzipFile(fileobj=stream))
        yield stream


@dataclass(frozen=True)
class WebPage:
    """One HTML response of a web archive, as text (empty when nothing but markup), with where it came from."""

    text: str
    url: str
    date: str


def warc_pages(fs, rel: str, s: ReadSettings, dropped: dict[str, int]) -> Iterator[WebPage]:
    """The HTML responses of one WARC file (.warc or .warc.gz, read by warcio as a stream, record by record), each
    page's text extracted as `format: html` does (split into sections when asked: then one WebPage per section).
    Requests, metadata and non-HTML responses are passed over; a response longer than the byte cap is dropped
    unread (`dropped['too_long']`); a file that is not a web archive is a MalformedData error naming it."""
    from warcio.archiveiterator import ArchiveIterator
    from warcio.exceptions import ArchiveLoadFailed

    max_bytes = s.max_document_chars * BYTES_PER_CHAR
    where = f"{s.uri.rstrip('/')}/{rel}"
    with fs.open(rel, "rb") as raw:
        stream = io.BufferedReader(raw, buffer_size=1 << 20) if isinstance(raw, AbstractBufferedFile) else raw
        try:
            for record in ArchiveIterator(stream):
                if record.format != "warc":  # warcio reads any text line as a legacy ARC header: not ours
                    raise ArchiveLoadFailed(f"a {record.format.upper()} record, not a WARC record")
                if record.rec_type != "response" or record.http_headers is None:
                    continue
                kind = (record.http_headers.get_header("Content-Type") or "").split(";")[0].strip().lower()
                if kind not in ("text/html", "application/xhtml+xml"):
                    dropped["not_html"] = dropped.get("not_html", 0) + 1
                    continue
                body = record.content_stream().read(max_bytes + 1)
                if len(body) > max_bytes:
                    dropped["too_long"] = dropped.get("too_long", 0) + 1
                    continue
                url = record.rec_headers.get_header("WARC-Target-URI") or ""
                date = record.rec_headers.get_header("WARC-Date") or ""
                parts = _group(_html_sections(body), s.section_chars) if s.split == "sections" else [html_text(body)]
                yield from (WebPage(part.strip(), url, date) for part in (parts or [""]))
        except ArchiveLoadFailed as exc:
            raise MalformedData(f"{where}: not a web archive (WARC): {str(exc).strip()}") from None


def drop_reason(text: str, max_chars: int) -> str:
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


def _parsed(line: bytes):
    """orjson's parse (several times the standard library's); a line it refuses is parsed again by the standard
    library, for the error message users know (what is wrong, at which column)."""

    try:
        return orjson.loads(line)
    except orjson.JSONDecodeError:
        return json.loads(line.decode("utf-8"))


def _jsonl_records(stream, key: str, where: str, max_bytes: int, dropped: dict[str, int]) -> Iterator[str]:
    return (str(record.get(key, "")) for _, record in jsonl_objects(stream, key, where, max_bytes, dropped))


def jsonl_objects(stream, key: str, where: str, max_bytes: int,
                  dropped: dict[str, int]) -> Iterator[tuple[int, dict]]:
    """(line number, record) of a JSONL stream; a line that is no JSON object is a MalformedData error naming the
    file (`where`) and the line, a line over `max_bytes` is counted in `dropped['too_long']` and left out."""
    for number, line in _bounded_lines(stream, max_bytes):
        if line is None:
            dropped["too_long"] = dropped.get("too_long", 0) + 1
            continue
        line = line.rstrip(b"\r\n")
        if not line.strip():
            continue
        try:
            record = _parsed(line)
        except UnicodeDecodeError as exc:
            raise MalformedData(f"{where}:{number}: not UTF-8 (byte 0x{line[exc.start]:02x} at column "
                                f"{exc.start + 1})") from None
        except json.JSONDecodeError as exc:
            raise MalformedData(f"{where}:{number}: not a JSON record: {exc.msg} at column {exc.colno}") from None
        if not isinstance(record, dict):
            raise MalformedData(f"{where}:{number}: a JSON {type(record).__name__}, not an object with '{key}'")
        yield number, record


PARQUET_BATCH_BYTES = 32 << 20  # text held as Python strings at once: 1,024 records of 1 MB took 2.6 GB


def _parquet_records(stream, key: str, where: str) -> Iterator[str]:
    """Row group by row group, in batches of about PARQUET_BATCH_BYTES of text (the rows' average size, from the
    file's metadata): memory follows the batch, not the file nor the row count."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        if not stream.seekable():  # a .parquet.gz
            stream = io.BytesIO(stream.read())
        parquet = pq.ParquetFile(stream)
        batches = parquet.iter_batches(columns=[key], batch_size=_rows_per_batch(parquet, key))
        for batch in batches:
            column = batch.column(0)
            for i in range(len(column)):  # one record as a Python string at a time
                yield str(column[i].as_py())
    except (pa.ArrowInvalid, KeyError, ValueError) as exc:
        raise MalformedData(f"{where}: not a parquet file with a '{key}' column ({exc})") from None


def _rows_per_batch(parquet, key: str) -> int:
    meta = parquet.metadata
    column = parquet.schema_arrow.get_field_index(key)
    if column < 0 or meta.num_rows == 0:
        return 1024
    size = sum(meta.row_group(g).column(column).total_uncompressed_size for g in range(meta.num_row_groups))
    return max(1, min(1024, PARQUET_BATCH_BYTES * meta.num_rows // max(1, size)))


def _html_tree(raw: bytes):

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


def html_text(raw: bytes) -> str:
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
