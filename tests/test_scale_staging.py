"""What a node stages grows with the tokens its step draws, not with the corpus (issue 73, C2/H5/M4).

Before, rows read blocks of the whole corpus in a shuffled order, so a one-node ablation at the full global batch
staged every shard of its mixture (~20 TB for SmolLM3's 45B-token ablations) and every node copied every shard's
offsets. Now a stage reads a window sized from what it draws (model/training/windows.py): the resource ledger's
copied bytes are held to the plan's model (specs/staging_costs.py) at three step counts and three corpus sizes;
the window is what the packer reads, staged or not; copies beyond the node's scratch are evicted least recently
used first, a copy that cannot fit stops before copying, a cut copy resumes; and validation refuses a step whose
share exceeds how.storage.local_cache_gib.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from compass.infra.resource_ledger import parts
from compass.infra.store import Store
from compass.model.training.job import StageRecipe, Staging
from compass.model.training.packing import RowPacker
from compass.model.training.staging import stage_sources
from compass.model.training.token_files import TokenizedSource, token_dtype, write_counts, write_meta, write_split
from compass.model.training.windows import SourceSize, Window, stage_windows
from compass.specs.staging_costs import staged_bytes
from compass.specs.training import Monitors, Optimizer, PretrainStage, Schedule
from tests.test_store import manifest_for

DOC = 128  # tokens of every document (127 + EOS)
PER_SHARD = 100  # documents
ROWS, SEQ = 8, DOC  # the global batch, one node reads every row
VOCAB = 60000  # uint16 ids: 2 bytes a token, as the plan's model says for such a vocabulary


def corpus(store: Store, shards: int, tag: str) -> str:
    """A committed token shard set of `shards` shards (counts file as the tokenize step writes), its URI."""
    dtype = token_dtype(VOCAB)
    with store.staging() as out:
        for shard in range(shards):
            ids = range(shard * PER_SHARD, (shard + 1) * PER_SHARD)
            write_split(out, "train", ([1 + i % 50000] * (DOC - 1) for i in ids), 0, dtype, shard=shard)
        write_counts(out, "train", [PER_SHARD] * shards, [PER_SHARD * DOC] * shards)
        write_meta(out, dtype, 0, VOCAB)
        manifest = store.commit(out, manifest_for(store, "tokenize", f"web{tag}", tag.ljust(64, "0")))
    return manifest.uri


def recipe(*steps: int) -> StageRecipe:
    stages = [PretrainStage(name=f"s{i}", tokens=n * ROWS * SEQ, sequence_length=SEQ, global_batch_size=ROWS,
                            mixture={"web": 1.0}) for i, n in enumerate(steps)]
    from compass.specs.architecture import Architecture

    arch = Architecture(num_layers=1, hidden_size=8, ffn_size=16, num_heads=1, num_kv_heads=1, vocab_size=VOCAB)
    return StageRecipe(architecture=arch, optimizer=Optimizer(), schedule=Schedule(kind="constant"),
                       stages=stages, stage=stages[-1].name, seed=0, intra_document_masking=True, monitors=Monitors())


def staged_on_one_node(tmp_path: Path, store: Store, uri: str, job: StageRecipe, name: str) -> int:
    """Bytes the node copied (its resource ledger part) staging every row of `job`'s stage."""
    work = tmp_path / f"work-{name}"
    staging = Staging(store_root=store.root, cache=tmp_path / f"nvme-{name}", uris={"web": uri})
    stage_sources(staging, 0, range(ROWS), ROWS, work, recipe=job)
    return parts(work).copied


def test_a_nodes_copy_grows_with_the_steps_its_stage_draws_and_not_with_the_corpus(tmp_path: Path):
    store = Store(str(tmp_path / "store"))
    uris = {shards: corpus(store, shards, f"c{shards}") for shards in (32, 64, 128)}
    by_steps = {steps: staged_on_one_node(tmp_path, store, uris[32], recipe(steps), f"s{steps}") for steps in
                (20, 40, 80)}  # windows of 200, 400 and 800 documents: 2, 4, 8 of the 32 shards
    for steps, copied in by_steps.items():
        model = staged_bytes(steps * ROWS * SEQ, VOCAB, 1)
        assert abs(copied / model - 1) < 0.10, (steps, copied, model)
    by_corpus = {shards: staged_on_one_node(tmp_path, store, uri, recipe(40), f"c{shards}")
                 for shards, uri in uris.items()}
    assert max(by_corpus.values()) / min(by_corpus.values()) < 1.02, by_corpus  # 1x, 2x, 4x the corpus: flat
    whole = 32 * PER_SHARD * DOC * 2
    assert by_steps[20] < whole / 10  # before: every shard of the corpus (the rows spanned all of it)


def test_the_packer_reads_only_its_window_the_same_documents_staged_or_not(tmp_path: Path):
    store = Store(str(tmp_path / "store"))
    uri = corpus(store, 32, "w")
    job = recipe(40)
    copy = stage_sources(Staging(store_root=store.root, cache=tmp_path / "nvme", uris={"web": uri}), 0,
                         range(ROWS), ROWS, recipe=job)["web"]
    assert sorted(p.name for p in (copy / "train").glob("*")) == [f"0000{i}.{k}" for i in range(4)
                                                                   for k in ("offsets.npy", "tokens")]

    def documents(folder: Path) -> set[int]:
        source = TokenizedSource(folder)
        windows = stage_windows(job, {"web": SourceSize(source.n_documents, source.n_tokens)})
        assert windows == {"web": Window(0, 400)}
        packer = RowPacker({"web": source}, {"web": 1.0}, SEQ, seed=3, rows=ROWS, windows=windows)
        seen = set()
        for _ in range(40):
            first = packer.next_batch().input_ids[:, 0].numpy()
            seen |= set(first.tolist())
        return seen

    assert documents(copy) == documents(Path(store.local_path(uri)))  # no byte outside the staged shards read
    assert max(documents(copy)) <= 400  # token ids 1 + document index


def test_each_stage_reads_on_from_where_the_previous_stages_window_ended():
    sizes = {"web": SourceSize(3200, 3200 * DOC)}
    assert stage_windows(recipe(20), sizes) == {"web": Window(0, 200)}
    assert stage_windows(recipe(20, 40), sizes) == {"web": Window(200, 400)}
    assert stage_windows(recipe(20, 40, 3000), sizes) == {"web": Window(0, 3200)}  # more than the source: whole
    wrapped = stage_windows(recipe(300, 40), sizes)["web"]  # the first stage read documents 0-2999
    assert wrapped == Window(3000, 400) and [wrapped.index(i, 3200) for i in (0, 199, 200, 399)] == [3000, 3199,
                                                                                                      0, 199]
    assert stage_windows(recipe(400, 40), sizes)["web"] == Window(0, 400)  # the first stage read it all
    from compass.model.training.staging import needed_shards

    shards = {f"train/{i:05d}.tokens": PER_SHARD for i in range(32)}
    assert needed_shards(shards, range(ROWS), ROWS, wrapped) == {f"train/{i:05d}.tokens" for i in (30, 31, 0, 1)}
    assert needed_shards(shards, range(4, 8), ROWS, wrapped) == {"train/00000.tokens", "train/00001.tokens"}


def test_older_copies_make_room_least_recently_used_first_and_a_copy_that_cannot_fit_stops_first(tmp_path: Path):
    from compass.model.training.node_scratch import ScratchFull

    store = Store(str(tmp_path / "store"))
    uris = [corpus(store, 8, f"e{i}") for i in range(3)]  # each stage of 40 steps: its 4 shards, ~104 KB
    cache = tmp_path / "nvme"

    def stage(uri: str, capacity: int | None) -> Path:
        return stage_sources(Staging(store_root=store.root, cache=cache, uris={"web": uri}, capacity_bytes=capacity),
                             0, range(ROWS), ROWS, recipe=recipe(40))["web"]

    first, second = stage(uris[0], None), stage(uris[1], None)
    stage(uris[0], None)  # reused: now the most recently used
    third = stage(uris[2], 250_000)  # room for two copies: the least recently used one goes
    assert first.exists() and not second.exists() and third.exists()
    with pytest.raises(ScratchFull, match=r"needs 0.\d+ GiB more; local_cache_gib 0.0 GiB.*larger disk"):
        stage(uris[1], 50_000)  # less than one copy: refused before a byte is copied
    assert not any(p.name.startswith(second.name) and p.is_dir() for p in cache.iterdir())


def test_a_cut_copy_resumes_keeping_the_files_it_verified(tmp_path: Path):
    from compass.infra.resource_ledger import Ledger, counting

    store = Store(str(tmp_path / "store"))
    uri = corpus(store, 8, "r")
    target = store.staged_path(uri, tmp_path / "nvme")
    calls = []
    real = store.fs.get_file

    def cut(src: str, dst: str) -> None:
        if len(calls) == 3:
            raise ConnectionError("the node lost the store")
        calls.append(src)
        real(src, dst)

    store.fs.get_file = cut  # type: ignore[method-assign]
    with pytest.raises(ConnectionError):
        store.copy_verified(uri, tmp_path / "nvme")
    store.fs.get_file = real  # type: ignore[method-assign]
    kept = (target.with_name(target.name + ".part") / ".verified").read_text().split()
    assert len(kept) == 3
    ledger = Ledger()
    with counting(ledger):
        copy = store.copy_verified(uri, tmp_path / "nvme")
    files = {e.path: e.size for e in store.read_manifest(uri).files}
    assert ledger.snapshot().copied == sum(files.values()) - sum(files[p] for p in kept)
    assert all((copy / p).stat().st_size == n for p, n in files.items())
    assert not target.with_name(target.name + ".part").exists()


def test_validation_refuses_a_step_whose_share_exceeds_the_nodes_scratch(tmp_path: Path):
    from compass.flows.reports.plan_tables import staging_section
    from compass.flows.validation import load_checked
    from compass.specs.loader import SpecError
    from tests.conftest import REPO

    example = (REPO / "specs/examples/smollm3-3b.yaml").read_text()
    table = staging_section(load_checked(REPO / "specs/examples/smollm3-3b.yaml", machine=False).spec)
    assert table is not None and [r[0] for r in table.rows][:3] == ["pretrain:stage1", "pretrain:stage2",
                                                                   "pretrain:stage3"]
    assert {r[4] for r in table.rows} == {"yes"} and "ablate:*" in [r[0] for r in table.rows]
    small = tmp_path / "smollm3-3b.yaml"
    small.write_text(example.replace("local_cache_gib: 3000", "local_cache_gib: 500"))
    with pytest.raises(SpecError, match=r"how.storage.local_cache_gib: pretrain:stage1 stages 790 GiB .* each of "
                                        r"its 48 node\(s\).*give how.resources.pretraining more nodes") as refused:
        load_checked(small, machine=False)
    assert "stage2" not in str(refused.value)  # 171 GiB fits
    assert not any(p.name != small.name for p in tmp_path.iterdir())  # nothing written
    unused = tmp_path / "unused.yaml"
    unused.write_text(example.replace("local_cache: /scratch/compass, ", ""))
    with pytest.raises(SpecError, match=r"local_cache_gib has no effect here"):
        load_checked(unused, machine=False)


def test_the_ledger_counts_each_nodes_copy_under_its_host(tmp_path: Path):
    store = Store(str(tmp_path / "store"))
    uri = corpus(store, 8, "h")
    work = tmp_path / "work"
    stage_sources(Staging(store_root=store.root, cache=tmp_path / "nvme", uris={"web": uri}), 0, range(ROWS), ROWS,
                  work, recipe=recipe(40))
    part = json.loads(next(work.rglob("staging-*")).read_text()) if list(work.rglob("staging-*")) else None
    assert part is not None and np.isclose(sum(part["copied_by_node"].values()), part["copied"])
