"""What an evaluate step takes of a tokenized source: the held-out sample it scores (model/training/heldout_sample.py),
never the rest of the split. The sample is chosen from the split's counts file, read first (a few KB); a remote
store then copies only the sample's shards, and the step's resource ledger counts only them."""

from __future__ import annotations

from pathlib import Path

from compass.infra.layout import HELDOUT
from compass.model.training.heldout_sample import sample_files, sampled_shards
from compass.model.training.token_files import META, counts_path, read_counts, split_parts
from compass.tasks.steps.context import InputArtifact


def heldout_sample(tokens: InputArtifact) -> Path:
    """A local folder holding the held-out sample of `tokens` (the store's own folder for a local store)."""
    counts = counts_path(Path(), HELDOUT).as_posix()
    if not any(e.path == counts for e in tokens.manifest.files):  # written without counts: the whole split
        return tokens.local(*split_parts(HELDOUT))
    folder = tokens.local_files({META, counts})
    _, per_shard = read_counts((folder / counts).read_text(), f"{tokens.uri}/{counts}")
    return tokens.local_files(sample_files(HELDOUT, sampled_shards(per_shard)))
