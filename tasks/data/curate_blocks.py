"""datatrove building blocks compass adds: offline language id, a train/held-out router and the measure of what
passes (documents, words, bytes: curation's in and out figures, counted in the pass that reads the data anyway).

Module-level and importable, because datatrove's local executor re-imports them in worker processes.
"""

from __future__ import annotations

import hashlib
import re
import sys
from functools import cached_property

from datatrove.data import Document, DocumentsPipeline
from datatrove.pipeline.base import PipelineStep
from datatrove.pipeline.filters import (
    C4QualityFilter,
    FineWebQualityFilter,
    GopherQualityFilter,
    GopherRepetitionFilter,
    RegexFilter,
    URLFilter,
)
from datatrove.pipeline.filters.base_filter import BaseFilter
from datatrove.pipeline.writers import JsonlWriter

from compass.infra.layout import HELDOUT, SHARD_SUFFIX, TRAIN
from compass.specs.data import HeldoutUnit
from compass.tasks.data.shard_codec import SHARD_CODEC

WORD = re.compile(r"\w+", re.UNICODE)

FILTERS: dict[str, type[BaseFilter]] = {
    "gopher_quality": GopherQualityFilter,
    "gopher_repetition": GopherRepetitionFilter,
    "c4_quality": C4QualityFilter,
    "fineweb_quality": FineWebQualityFilter,
    "regex": RegexFilter,
    "url": URLFilter,
}


class LanguageIdFilter(BaseFilter):
    """Tags `metadata['language']` with py3langid (offline) and drops documents outside `keep`."""

    name = "🌍 py3langid"

    def __init__(self, keep: list[str], min_score: float, fixed_language: str | None = None):
        super().__init__()
        self.keep = set(keep)
        self.min_score = min_score
        self.fixed_language = fixed_language

    @cached_property
    def identifier(self):
        from py3langid.langid import MODEL_FILE, LanguageIdentifier

        return LanguageIdentifier.from_model_file(MODEL_FILE, norm_probs=True)

    def filter(self, doc: Document) -> bool | tuple[bool, str]:
        language, score = self.identifier.classify(doc.text[:4000])
        doc.metadata["detected_language"] = language
        doc.metadata["language_score"] = round(float(score), 4)
        if self.keep and language not in self.keep:
            return False, "language"
        if score < self.min_score:
            return False, "language_score"
        doc.metadata.setdefault("language", self.fixed_language or language)
        return True


def heldout_bucket(doc_id: str) -> float:
    """A stable number in [0, 1) from a document id: the same document is always on the same side."""
    return int(hashlib.sha1(doc_id.encode()).hexdigest()[:8], 16) / 0x100000000


# The text last measured, with its words and bytes. Curation without filters measures each document twice in one
# pass (its input, then its split): the second block reuses the first's count while the text is the same object.
_last_measured: tuple[str | None, int, int] = (None, 0, 0)


def _words_and_bytes(text: str) -> tuple[int, int]:
    global _last_measured
    last, words, size = _last_measured  # one read: a tuple swapped whole, never half-updated
    if last is not text:
        words, size = len(WORD.findall(text)), len(text.encode())
        _last_measured = (text, words, size)
    return words, size


def measure(step: PipelineStep, doc: Document, prefix: str = "") -> None:
    """Count one document into the block's statistics: `<prefix>documents`, `<prefix>words`, `<prefix>bytes`."""
    words, size = _words_and_bytes(doc.text)
    step.stat_update(f"{prefix}documents")
    step.stat_update(f"{prefix}words", value=words)
    step.stat_update(f"{prefix}bytes", value=size)


class Measure(PipelineStep):
    """Counts the documents, words and UTF-8 bytes that pass (curation's input, right after its first reader)."""

    name = "📏 measure"
    type = "📊 - STATS"

    def run(self, data: DocumentsPipeline, rank: int = 0, world_size: int = 1) -> DocumentsPipeline:
        for doc in data:
            measure(self, doc)
            yield doc


def unit_of(doc: Document, unit: HeldoutUnit) -> str:
    """What decides a document's side of the split: its id, its file (`path`), or its page (`url`)."""
    key = {"file": "path", "page": "url"}.get(unit)
    return str(doc.metadata.get(key) or doc.id) if key else doc.id


class SplitTagger(PipelineStep):
    """Marks each document train or heldout by a hash of its unit (the document, or the file or page its sections
    come from: a unit is never on both sides), for writers that use `${split}` in file names, and measures each
    split (`train_documents`, `train_words`, ...)."""

    name = "✂️ train/heldout"
    type = "🔢 - SPLIT"

    def __init__(self, heldout_fraction: float, unit: HeldoutUnit = "document"):
        super().__init__()
        self.heldout_fraction = heldout_fraction
        self.unit = unit

    def run(self, data: DocumentsPipeline, rank: int = 0, world_size: int = 1) -> DocumentsPipeline:
        for doc in data:
            split = HELDOUT if heldout_bucket(unit_of(doc, self.unit)) < self.heldout_fraction else TRAIN
            doc.metadata["split"] = split
            measure(self, doc, f"{split}_")
            yield doc


def document_text(doc: Document) -> str:
    """Content getter for exact dedup (module-level and annotated: datatrove inspects the return type)."""
    return doc.text


def _quiet_console_task_logger():
    """datatrove sends every task's INFO log to stderr, which buries compass's own progress. Keep its full
    log files (they become part of the artifact) and show only warnings on the console. Patched here because
    worker processes import this module to unpickle the blocks above, so they get the same behaviour."""

    import datatrove.executor.base as executor_base
    from datatrove.utils.logging import add_task_logger, close_task_logger, logger

    if getattr(executor_base.add_task_logger, "_compass_quiet", False):
        return

    def quiet_console() -> None:  # one line a message: a failed rank's traceback is in its log file
        logger.remove()
        logger.add(sys.stderr, level="WARNING", format=lambda _: "datatrove {level}: {message}\n")

    def add_quiet_task_logger(logging_dir, rank: int, local_rank: int = 0, node_rank: int = -1):
        logfile = add_task_logger(logging_dir, rank, local_rank, node_rank=node_rank)
        logger.remove()
        quiet_console()
        logger.add(logfile, level="DEBUG", format="{time:YYYY-MM-DD HH:mm:ss.SSS} | {level: <8} | {message}")
        return logfile

    def close_quiet_task_logger(logfile) -> None:
        close_task_logger(logfile)  # re-adds datatrove's default console logger
        quiet_console()

    add_quiet_task_logger._compass_quiet = True  # type: ignore[attr-defined]
    executor_base.add_task_logger = add_quiet_task_logger
    executor_base.close_task_logger = close_quiet_task_logger
    quiet_console()


_quiet_console_task_logger()


def portable_record(writer, document) -> dict:
    """JsonlWriter adapter for curated output: datatrove's record without the reader's `file_path`, an
    absolute path into the store that would make the same data differ between stores and machines."""
    data = writer._default_adapter(document)
    data.get("metadata", {}).pop("file_path", None)
    return data


class ShardWriter(JsonlWriter):
    """datatrove's JsonlWriter writing reproducible zstd shards (importing this module registers the codec, also in
    a Slurm array task that unpickles the pipeline). `written_records`: a folder where each rank records the
    path, size and sha256 of the shards it wrote (tasks/data/written_files.py), for a commit that does not read
    them back."""

    def __init__(self, output_folder: str, output_filename: str = "${rank}" + SHARD_SUFFIX,
                 written_records: str | None = None, **kwargs):
        super().__init__(output_folder, output_filename=output_filename, compression=SHARD_CODEC, **kwargs)
        self.written_records = written_records
        if written_records:
            from compass.tasks.data.written_files import DigestingOutputFiles

            self.output_mg = DigestingOutputFiles(self.output_folder, mode="wb", compression=SHARD_CODEC)

    def _default_adapter(self, document: Document) -> dict:
        """datatrove's record (the non-empty fields, in field order) without dataclasses.asdict's deep copy, which
        cost as much as compressing the shard; the same bytes on disk."""
        if document.media or self.expand_metadata:
            return super()._default_adapter(document)
        record = {"text": document.text, "id": document.id, "metadata": dict(document.metadata)}
        return {key: value for key, value in record.items() if value}

    def run(self, data: DocumentsPipeline, rank: int = 0, world_size: int = 1) -> DocumentsPipeline:
        if not self.written_records:
            yield from super().run(data, rank, world_size)
            return
        from compass.tasks.data.written_files import record

        self.output_mg.written = []  # in-process ranks share this writer
        yield from super().run(data, rank, world_size)  # closes (and so digests) every shard at its end
        record(self.written_records, rank, self.output_mg.written)
