"""Ingest's datatrove reader: one rank's group of a raw source's files read into documents (tasks/data/source_files.py
reads each file); sharding over ranks, completion markers and statistics are datatrove's.

Module-level and importable on its own, because datatrove's workers and Slurm array tasks unpickle the reader.
"""

from __future__ import annotations

import json
from pathlib import Path

from datatrove.data import Document, DocumentsPipeline
from datatrove.pipeline.readers.base import BaseDiskReader

from compass.tasks.data.source_files import ReadSettings, drop_reason, file_texts, warc_pages


class SourceReader(BaseDiskReader):
    """Reads rank r's group of files (`groups[r]`, paths under `data_folder`, contiguous in the source's sorted
    order) and yields its documents that are training text. Statistics: `documents`, `characters`, and
    `dropped_<reason>` for records dropped unread or by content; files that are not text are skipped and named in
    `skipped_folder/<rank>.json` (datatrove's statistics hold numbers only)."""

    name = "📂 source files"
    type = "📖 - READER"

    def __init__(self, data_folder: str, groups: list[list[str]], settings: ReadSettings, skipped_folder: str,
                 limit: int = -1):
        super().__init__(data_folder, limit=limit, doc_progress=False, file_progress=False)
        self.groups, self.settings, self.skipped_folder = groups, settings, skipped_folder
        self.skipped: dict[str, str] = {}

    def run(self, data: DocumentsPipeline = None, rank: int = 0, world_size: int = 1) -> DocumentsPipeline:
        if data:
            yield from data
        self.skipped = {}
        for doc in self.read_files_shard(self.groups[rank]):
            self.update_doc_stats(doc)
            yield doc
        folder = Path(self.skipped_folder)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"{rank:05d}.json").write_text(json.dumps(self.skipped))

    def read_file(self, filepath: str) -> DocumentsPipeline:
        s = self.settings
        meta = {"source": s.source, "domain": s.domain} | ({"language": s.language} if s.language else {})
        dropped: dict[str, int] = {}
        if s.format == "warc":  # a page keeps its URL (datatrove's URL filter reads it) and its crawl date
            texts = ((page.text, {"url": page.url, "date": page.date})
                     for page in warc_pages(self.data_folder, filepath, s, dropped))
        else:
            texts = ((text, {}) for text in file_texts(self.data_folder, filepath, s, self.skipped, dropped))
        for i, (text, origin) in enumerate(texts):
            if not text:
                continue
            reason = drop_reason(text, s.max_document_chars)
            if reason:
                dropped[reason] = dropped.get(reason, 0) + 1
                continue
            self.stat_update("characters", value=len(text))
            yield Document(text=text, id=f"{s.source}/{filepath}#{i}", metadata={**meta, "path": filepath, **origin})
        for reason, n in dropped.items():
            self.stat_update(f"dropped_{reason}", value=n)
