"""The decontamination fence's datatrove blocks (a module of their own: Slurm array tasks unpickle them). Each rank
loads the fence's index from its folder once (tasks/data/decontamination.py)."""

from __future__ import annotations

import json
from pathlib import Path

from datatrove.data import Document, DocumentsPipeline
from datatrove.pipeline.base import PipelineStep
from datatrove.pipeline.filters.base_filter import BaseFilter


def _document_name(doc: Document) -> str:
    return str(doc.metadata.get("file") or doc.metadata.get("url") or doc.id)


class FenceScan(PipelineStep):
    """Matches each document against the fence and writes the rank's report (`<reports>/<rank>.json`: documents
    scanned, matched per benchmark, the items hit, a few examples); nothing is removed."""

    name = "🚧 fence scan"
    type = "🦠 - DECONT"

    def __init__(self, fence_folder: str, reports: str, source: str):
        super().__init__()
        self.fence_folder, self.reports, self.source = fence_folder, reports, source

    def run(self, data: DocumentsPipeline, rank: int = 0, world_size: int = 1) -> DocumentsPipeline:
        from compass.tasks.data.decontamination import Fence, Matcher, SourceReport

        fence = Fence.read(self.fence_folder)
        matcher = Matcher(fence)
        report = SourceReport(self.source)
        for doc in data:
            hit = matcher.match(doc.text)
            report.add(hit, _document_name(doc), fence)
            self.stat_update("documents")
            if hit is not None:
                self.stat_update(f"contaminated_{hit.benchmark}")
        out = Path(self.reports)
        out.mkdir(parents=True, exist_ok=True)
        data_out = report.as_json() | {"item_ids": {b: sorted(ids) for b, ids in report.items.items()}}
        (out / f"{rank:05d}.json").write_text(json.dumps(data_out))
        return iter(())


class FenceFilter(BaseFilter):
    """Drops each document that matches the fence (the policy `remove`, before tokenizing); the dropped
    count per benchmark is in the stage's statistics (`dropped_contaminated_<benchmark>`)."""

    name = "🚧 fence"
    type = "🦠 - DECONT"

    def __init__(self, fence_folder: str):
        super().__init__()
        self.fence_folder = fence_folder
        self._matcher = None

    def filter(self, doc: Document) -> bool | tuple[bool, str]:
        if self._matcher is None:
            from compass.tasks.data.decontamination import Fence, Matcher

            self._matcher = Matcher(Fence.read(self.fence_folder))
        hit = self._matcher.match(doc.text)
        if hit is None:
            return True
        return False, f"contaminated_{hit.benchmark}"
