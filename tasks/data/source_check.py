"""A record source's files read at validation, as far as validation affords: a broken JSONL line or a text column
that is not there used to pass `compass validate` and stop the run at its ingest step, after the steps before it
(and with advice to run again, which cannot help bad data). Reads the first records of every file (of at most
FILES_CHECKED spread over a larger source) and many more of a few files spread over it: validation opens at most
about a thousand files, whatever the source's size."""

from __future__ import annotations

import io
from dataclasses import dataclass
from itertools import islice
from typing import Literal

from compass.infra.errors import MalformedData
from compass.tasks.data.source_files import BYTES_PER_CHAR, jsonl_objects, opened

FIRST_RECORDS = 16  # of every file checked
FILES_CHECKED = 1024  # a source of more files has this many checked, spread evenly over it
SAMPLED_FILES = 32  # spread evenly over the source's files, each read further
SAMPLED_RECORDS = 4096


@dataclass(frozen=True)
class RecordProblem:
    """Why the source's ingest would stop, where (file:line), and the fix that fits it."""

    message: str
    hint: str


def record_problem(fs, root: str, files: list[str], format: Literal["jsonl", "parquet"], text_key: str,
                   max_document_chars: int) -> RecordProblem | None:
    """The first problem the source's files give its ingest step (None: the records read); `files` relative to
    `root`, in the order ingest reads them."""
    sampled = set(_spread(files, SAMPLED_FILES))
    for rel in _spread(files, FILES_CHECKED):
        where = f"{root.rstrip('/')}/{rel}"
        try:
            with opened(fs, where) as stream:
                if format == "parquet":
                    problem = _parquet_problem(stream, where, text_key)
                else:
                    limit = SAMPLED_RECORDS if rel in sampled else FIRST_RECORDS
                    problem = _jsonl_problem(stream, where, text_key, max_document_chars * BYTES_PER_CHAR, limit)
        except MalformedData as exc:
            return RecordProblem(str(exc), "fix or remove that line, or leave the file out with exclude: "
                                           "ingest stops at it every time")
        except (OSError, EOFError) as exc:  # a gzip cut short, an unreadable file
            return RecordProblem(f"{where}: cannot be read ({exc})", "replace the file, or leave it out with exclude")
        if problem is not None:
            return problem
    return None


def _spread(files: list[str], most: int) -> list[str]:
    """At most `most` of the files, evenly spread over them, in their order."""
    step = max(1, -(-len(files) // most))
    return files[::step][:most]


def _jsonl_problem(stream, where: str, key: str, max_bytes: int, limit: int) -> RecordProblem | None:
    """Lines that are no JSON object raise MalformedData; records of which none holds `key` are a problem."""
    first_keys: list[str] | None = None
    keyed = False
    for _, record in islice(jsonl_objects(stream, key, where, max_bytes, {}), limit):
        keyed = keyed or key in record
        if first_keys is None:
            first_keys = list(record)
    if keyed or first_keys is None:  # (an empty file gives no document, and stops nothing)
        return None
    return RecordProblem(f"{where}: no record among its first lines has the key '{key}' (the first has: "
                         f"{', '.join(first_keys) or 'no key'})",
                         "set text_key to the key holding the text")


def _parquet_problem(stream, where: str, key: str) -> RecordProblem | None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        if not stream.seekable():  # a .parquet.gz: the footer is at its end
            stream = io.BytesIO(stream.read())
        names = pq.read_schema(stream).names
    except (pa.ArrowInvalid, ValueError) as exc:
        return RecordProblem(f"{where}: not a parquet file ({exc})", "replace the file, or leave it out with exclude")
    if key in names:
        return None
    return RecordProblem(f"{where}: has no column '{key}' (its columns: {', '.join(names)})",
                         "set text_key to the column holding the text")
