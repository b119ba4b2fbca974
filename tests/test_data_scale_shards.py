"""The trainer's reading of a token shard set: documents indexed in order across the shards; two data-parallel ranks
packing their own rows see every document exactly once per epoch between them, a fresh order each epoch; and a
reader resumed from the ranks' saved states continues at the same document, with what an uninterrupted one packs."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from compass.model.training.packing import RowPacker, merge_states
from compass.model.training.token_files import TokenizedSource, token_dtype, write_meta, write_split

EOS = 0
DOCUMENTS = 300
ROWS = 4  # the global batch: rows 0-1 on rank 0, rows 2-3 on rank 1
LENGTH = 4  # every document 3 tokens + EOS, one per sequence: a sequence names its document


def _shard_set(folder: Path, shards: int = 3) -> TokenizedSource:
    dtype = token_dtype(DOCUMENTS + 2)
    per = DOCUMENTS // shards
    for shard in range(shards):
        ids = range(shard * per, (shard + 1) * per)
        write_split(folder, "train", ([i + 1] * (LENGTH - 1) for i in ids), EOS, dtype, shard=shard)
    write_meta(folder, dtype, EOS, DOCUMENTS + 2)
    return TokenizedSource(folder)


def _ranks(source: TokenizedSource) -> list[RowPacker]:
    return [RowPacker({"web": source}, {"web": 1.0}, LENGTH, seed=7, rows=ROWS, owned=range(r * 2, r * 2 + 2))
            for r in range(2)]


def _documents(ranks: list[RowPacker], batches: int) -> np.ndarray:
    """[batch, row] -> the document each row's sequence holds, the rows of both ranks side by side."""
    out = []
    for _ in range(batches):
        rows = np.concatenate([rank.next_batch().input_ids[:, 0].numpy() for rank in ranks])
        out.append(rows - 1)
    return np.stack(out)


def test_a_shard_set_reads_as_one_source_in_order(tmp_path: Path):
    source = _shard_set(tmp_path)
    assert len(source.shards) == 3 and source.n_documents == DOCUMENTS and source.n_tokens == DOCUMENTS * LENGTH
    for i in (0, 99, 100, 199, 200, DOCUMENTS - 1):  # across the shards' boundaries
        assert source.document(i).tolist() == [i + 1] * (LENGTH - 1) + [EOS]


def test_two_ranks_see_each_document_once_per_epoch_and_resume_at_the_same_document(tmp_path: Path):
    source = _shard_set(tmp_path)
    per_row = DOCUMENTS // ROWS
    seen = _documents(_ranks(source), 2 * per_row)
    for epoch in range(2):
        docs = seen[epoch * per_row: (epoch + 1) * per_row]
        assert sorted(docs.ravel().tolist()) == list(range(DOCUMENTS)), epoch  # once each, across both ranks
    assert (seen[:per_row] != seen[per_row:]).any()  # each epoch in a fresh order

    ranks = _ranks(source)
    _documents(ranks, 30)
    saved = merge_states([rank.state_dict() for rank in ranks])  # what a checkpoint holds
    resumed = _ranks(TokenizedSource(tmp_path))  # a new process after kill -9: the shards mapped again
    for rank in resumed:
        rank.load_state_dict(saved)
    assert (_documents(resumed, 40) == seen[30:70]).all()  # the same documents an uninterrupted reader packs
