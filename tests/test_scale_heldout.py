"""What scoring a held-out split reads grows with the sample it scores, not with the split (issue 73, C1 and H5).

Before, the evaluate step copied each perplexity source's whole held-out split from the store (5% of the corpus
by default: ~100B tokens of one SmolLM3 source, from S3, by every evaluate step) to score 16 sequences, passkey
retrieval read the whole split into memory as its haystack, and node-local staging copied the whole held-out split
onto every node. Now a fixed sample of shards spread over the split is read (model/training/heldout_sample.py):
held here at three split sizes, on a local store and on S3, against the plan's model of the evaluation's reads.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from compass.infra.layout import HELDOUT, TRAIN
from compass.infra.resource_ledger import Ledger, counting, parts
from compass.infra.store import Store
from compass.model.training.heldout_sample import SAMPLE_TOKENS, HeldoutSample, sampled_shards
from compass.model.training.token_files import TokenizedSource, token_dtype, write_counts, write_meta, write_split
from compass.tasks.evaluation.heldout_reads import heldout_sample
from compass.tasks.steps.context import InputArtifact
from tests.s3_server import RestartableS3, s3_on_loopback
from tests.test_store import manifest_for

DOC = 2**14  # tokens of a document (EOS included)
PER_SHARD = 64  # documents: 2**20 tokens a shard, half the sample
VOCAB = 60000  # uint16 ids
BUCKET = "heldout"
SIZES = (4, 8, 16)  # held-out shards of the three splits


def tokenized(store: Store, heldout_shards: int) -> str:
    """A committed tokenized source: 2 training shards and `heldout_shards` held-out shards, each document's
    tokens naming its split, shard and place."""
    dtype = token_dtype(VOCAB)
    with store.staging() as out:
        for split, shards in ((TRAIN, 2), (HELDOUT, heldout_shards)):
            for shard in range(shards):
                docs = (np.full(DOC - 1, 1 + (shard * PER_SHARD + d) % 50000, dtype=np.int64)
                        for d in range(PER_SHARD))
                write_split(out, split, docs, 0, dtype, shard=shard)
            write_counts(out, split, [PER_SHARD] * shards, [PER_SHARD * DOC] * shards)
        write_meta(out, dtype, 0, VOCAB)
        tag = f"{heldout_shards:x}".ljust(64, "0")
        return store.commit(out, manifest_for(store, "tokenize", f"web{heldout_shards}", tag)).uri


@pytest.fixture(scope="module")
def s3() -> Iterator[RestartableS3]:
    with s3_on_loopback(BUCKET) as server:
        yield server


def test_the_sample_is_the_whole_split_in_order_below_the_budget_and_spread_over_it_above():
    assert sampled_shards([100] * 5) == [0, 1, 2, 3, 4]  # a small run scores what it scored before
    shard = SAMPLE_TOKENS // 4
    for shards in (8, 64, 1000):
        chosen = sampled_shards([shard] * shards)
        assert len(chosen) == 4 and chosen[0] == 0 and chosen == sorted(set(chosen))
        assert chosen[-1] >= shards // 2  # spread: not the first four, which would be the early crawl alone
    assert sampled_shards([0, 0, shard * 8, 0]) == [2]  # empty shards hold nothing to score


@pytest.mark.parametrize("where", ["local", "s3"])
def test_an_evaluations_heldout_read_stays_the_sample_whatever_the_splits_size(tmp_path: Path, where: str,
                                                                               request: pytest.FixtureRequest,
                                                                               monkeypatch: pytest.MonkeyPatch):
    """At 4, 8 and 16 held-out shards the step is handed the same two shards' bytes (the model: the sample's
    tokens at the vocabulary's width) and no byte of the training split; on S3 only they are downloaded."""
    from compass.specs.staging_costs import token_bytes
    from compass.tasks.evaluation.costs import heldout_sample_bytes

    if where == "s3":
        for key, value in request.getfixturevalue("s3").env.items():
            monkeypatch.setenv(key, value)
        store = Store(f"s3://{BUCKET}/store", scratch_root=tmp_path / "scratch")
    else:
        store = Store(str(tmp_path / "store"))
    model = heldout_sample_bytes(VOCAB)
    assert model == SAMPLE_TOKENS * token_bytes(VOCAB)
    read = []
    for shards in SIZES:
        uri = tokenized(store, shards)
        artifact = InputArtifact("tokens:web", f"tokenize:web{shards}", uri, store.read_manifest(uri), store)
        ledger = Ledger()
        with counting(ledger):
            folder = heldout_sample(artifact)
        by_input = ledger.snapshot().read_by_input
        assert "tokens:web/train" not in by_input
        read.append(by_input["tokens:web/heldout"])
        sample = HeldoutSample(TokenizedSource(folder, HELDOUT))
        assert sample.shards == [0, shards // 2] and sample.n_tokens == SAMPLE_TOKENS
        assert int(sample.document(PER_SHARD)[0]) == 1 + shards // 2 * PER_SHARD  # shard N/2's first document
        assert len(sample.tokens) == SAMPLE_TOKENS
        if where == "s3":  # the download holds the sample and the small files, nothing else
            held = sorted(p.name for p in (folder / HELDOUT).iterdir())
            assert held == sorted(f"{s:05d}{end}" for s in (0, shards // 2) for end in (".tokens", ".offsets.npy"))
            assert not (folder / TRAIN).exists()
    assert read[0] == read[1] == read[2]
    assert model <= read[0] <= model * 1.1  # the offsets of two shards beside their tokens


def test_a_node_stages_the_heldout_sample_not_the_split(tmp_path: Path):
    """Node-local staging copied every held-out shard onto every node (the trainer's validation reads the sample):
    the copy of the held-out split is the same two shards at every size (of 8 MB copied, the counts file's
    few bytes a shard grow with the split)."""
    from compass.model.training.job import Staging
    from compass.model.training.staging import stage_sources

    store = Store(str(tmp_path / "store"))
    copied = []
    for shards in SIZES:
        uri = tokenized(store, shards)
        work = tmp_path / f"work-{shards}"
        staging = Staging(store_root=store.root, cache=tmp_path / f"nvme-{shards}", uris={"web": uri})
        (folder,) = stage_sources(staging, 0, range(1), 1, work).values()
        assert sorted(p.name for p in (folder / HELDOUT).glob("*.tokens")) == ["00000.tokens",
                                                                               f"{shards // 2:05d}.tokens"]
        copied.append(parts(work).copied)
    assert copied[2] - copied[0] < 1000  # the held-out counts file names each shard (a dozen bytes apiece)
