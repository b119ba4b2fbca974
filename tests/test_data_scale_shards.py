"""The trainer's reading of a token shard set: documents indexed in order across the shards; two data-parallel ranks
packing their own rows see every document exactly once per epoch between them, a fresh order each epoch; and a
reader resumed from the ranks' saved states continues at the same document, with what an uninterrupted one packs."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from compass.model.training.packing import RowPacker, merge_states
from compass.model.training.token_files import TokenizedSource, token_dtype, write_meta, write_split
from tests.test_remote_data import s3  # noqa: F401 - the S3 server fixture

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


def test_node_local_staging_copies_only_the_shards_its_rows_read(tmp_path: Path):
    """Rows read contiguous blocks of documents, so each node copies only the token shards of its ranks' rows (and
    every shard's offsets); its ranks read whole epochs from that copy, the same documents as from the store."""
    import pytest

    from compass.infra.store import Store
    from compass.model.training.job import Staging
    from compass.model.training.staging import stage_sources
    from tests.test_store import manifest_for

    store = Store(str(tmp_path / "store"))
    with store.staging() as out:
        _shard_set(out)
        manifest = store.commit(out, manifest_for(store, "tokenize", "web", "d" * 64))
    staging = Staging(store_root=store.root, cache=tmp_path / "nvme", uris={"web": manifest.uri})
    nodes = [stage_sources(staging, 0, range(2 * n, 2 * n + 2), ROWS)["web"] for n in range(2)]
    assert [sorted(p.name for p in (node / "train").glob("*.tokens")) for node in nodes] == [
        ["00000.tokens", "00001.tokens"], ["00001.tokens", "00002.tokens"]]  # documents 0-149 and 150-299
    assert all(len(list((node / "train").glob("*.offsets.npy"))) == 3 for node in nodes)

    from_nodes = [RowPacker({"web": TokenizedSource(node)}, {"web": 1.0}, LENGTH, seed=7, rows=ROWS,
                            owned=range(2 * n, 2 * n + 2)) for n, node in enumerate(nodes)]
    per_row = DOCUMENTS // ROWS
    whole = _documents(_ranks(TokenizedSource(Path(store.local_path(manifest.uri)))), 2 * per_row)
    assert (_documents(from_nodes, 2 * per_row) == whole).all()
    elsewhere = RowPacker({"web": TokenizedSource(nodes[0])}, {"web": 1.0}, LENGTH, seed=7, rows=ROWS,
                          owned=range(2, 4))  # another node's rows on this node's copy: refused, not misread
    with pytest.raises(FileNotFoundError, match="not in the folder"):
        for _ in range(per_row):
            elsewhere.next_batch()


def test_a_nodes_rows_are_those_of_its_ranks():
    from compass.model.training.packing import node_rows, rank_rows

    # 2 nodes x 4 GPUs, tensor parallel 2: 4 data-parallel ranks of 4 rows each; a node holds 2 of them
    assert [rank_rows(d, 4, 16) for d in range(4)] == [range(0, 4), range(4, 8), range(8, 12), range(12, 16)]
    assert {node_rows(rank, rank % 4, 4, 8, 2, 16) for rank in range(4)} == {range(0, 8)}
    assert {node_rows(rank, rank % 4, 4, 8, 2, 16) for rank in range(4, 8)} == {range(8, 16)}
    assert node_rows(0, 0, 1, 1, 1, 16) == range(0, 16)  # one process reads every row


def test_a_node_stages_its_shards_from_s3(s3, tmp_path: Path):  # noqa: F811
    from compass.infra.store import Store
    from compass.model.training.job import Staging
    from compass.model.training.staging import documents_per_shard, stage_sources
    from tests.test_store import manifest_for

    store = Store("s3://data/runs")
    with store.staging() as out:
        _shard_set(out)
        manifest = store.commit(out, manifest_for(store, "tokenize", "web", "e" * 64))
    assert list(documents_per_shard(store, manifest.uri).values()) == [100, 100, 100]  # from the headers alone
    staging = Staging(store_root=store.root, cache=tmp_path / "nvme", uris={"web": manifest.uri})
    node = stage_sources(staging, 0, range(2, 4), ROWS)["web"]
    assert sorted(p.name for p in (node / "train").glob("*.tokens")) == ["00001.tokens", "00002.tokens"]
    assert TokenizedSource(node).document(299).tolist() == [300] * (LENGTH - 1) + [EOS]


def test_a_splits_counts_file_indexes_its_shards_without_opening_them_until_a_document_is_read(s3, tmp_path: Path):  # noqa: F811
    """With `train.counts.json` (written by the tokenize step), node staging reads one small file of the store to
    pick its shards, and a reader maps a shard's offsets only when it reads one of its documents; a count that
    disagrees with its shard is found there."""
    from compass.infra.errors import DamagedArtifact
    from compass.infra.store import Store
    from compass.model.training.job import Staging
    from compass.model.training.staging import documents_per_shard, stage_sources
    from compass.model.training.token_files import write_counts
    from tests.test_store import manifest_for

    store = Store("s3://data/counted")
    with store.staging() as out:
        _shard_set(out)
        write_counts(out, "train", [100, 100, 100], [400, 400, 400])
        manifest = store.commit(out, manifest_for(store, "tokenize", "web", "f" * 64))
    heads = []
    store.read_head = lambda *args: heads.append(args)  # type: ignore[method-assign]  # headers: not read
    assert documents_per_shard(store, manifest.uri) == {f"train/0000{i}.tokens": 100 for i in range(3)}
    assert heads == []
    node = stage_sources(Staging(store_root=store.root, cache=tmp_path / "nvme", uris={"web": manifest.uri}), 0,
                         range(2, 4), ROWS)["web"]
    source = TokenizedSource(node)
    assert source.n_documents == 300 and source.n_tokens == 1200 and source._offsets == [None] * 3
    assert source.document(150).tolist() == [151] * (LENGTH - 1) + [EOS]
    assert [o is not None for o in source._offsets] == [False, True, False]  # only the shard read

    _shard_set(tmp_path / "local")
    write_counts(tmp_path / "local", "train", [100, 99, 100], [400, 400, 400])  # shard 1 miscounted
    wrong = TokenizedSource(tmp_path / "local")
    assert wrong.document(0).tolist() == [1] * (LENGTH - 1) + [EOS]
    with pytest.raises(DamagedArtifact, match=r"00001.offsets.npy: 100 documents and 400 tokens, its split's "
                                              r"counts say 99 and 400"):
        wrong.document(150)


def test_sequences_are_shuffled_across_the_whole_stage_not_read_in_document_order(tmp_path: Path):
    """The playbook's loader bug: sequences read in document order. Here the first batches already draw from every
    shard, no row reads its block in order, and each epoch's order is fresh."""
    source = _shard_set(tmp_path)
    per_row = DOCUMENTS // ROWS
    seen = _documents(_ranks(source), 2 * per_row)
    first = seen[:5].ravel()
    assert {int(d) // (DOCUMENTS // 3) for d in first} == {0, 1, 2}  # 5 batches touch all 3 shards
    for row in range(ROWS):
        epoch = seen[:per_row, row]
        assert not (np.diff(epoch) > 0).all()  # not in document order
        assert sorted(epoch.tolist()) == sorted(seen[per_row:, row].tolist())  # the same block again...
        assert (epoch != seen[per_row:, row]).any()  # ...in a fresh order
