"""Tokenizer selection measures on a fixed-size sample drawn across a source's shards, never on whole sources: the
first documents of a sample come from shards spread over the whole source, a held-out budget stops the reading
of a source once its groups are full, and a selection without a BPE candidate reads no training text at all."""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path

from compass.infra.store import Store
from compass.tasks.kinds import select_tokenizer as selection
from tests.shards import SHARD_SUFFIX, shard_records, write_shard


def committed(store, folder: Path):
    """`folder` committed to `store` as a curate artifact named after it: the input a step would get."""
    from compass.tasks.steps.context import InputArtifact
    from tests.test_store import manifest_for

    fingerprint = hashlib.sha256(folder.name.encode()).hexdigest()
    manifest = store.commit(folder, manifest_for(store, "curate", folder.name, fingerprint))
    return InputArtifact(folder.name, f"curate:{folder.name}", manifest.uri, manifest, store)


def _source(root: Path, shards: int, per_shard: int, language: str = "en") -> Path:
    """A curated source whose documents name their shard: `shard <i> doc <j>`."""
    for split in ("train", "heldout"):
        (root / split).mkdir(parents=True)
        for i in range(shards):
            write_shard(root / split / f"{i:05d}{SHARD_SUFFIX}", [
                {"text": f"shard {i} doc {j} " + "word " * 20, "metadata": {"language": language}}
                for j in range(per_shard)])
    return root


def test_a_sample_is_drawn_across_the_shards_from_a_bounded_number_of_them(tmp_path: Path):
    source = committed(Store(str(tmp_path / "store")), _source(tmp_path / "web", shards=200, per_shard=5))
    first = [doc.text.split()[1] for _, doc in zip(range(selection.SAMPLED_SHARDS),
                                                   selection._read(source, "train"), strict=False)]
    shards = sorted({int(s) for s in first})
    assert len(shards) == selection.SAMPLED_SHARDS  # one document from each sampled shard first
    assert shards[0] == 0 and shards[-1] >= 190  # spread over the whole source, not its first shards
    everything = list(selection._read(source, "train"))
    assert len(everything) == selection.SAMPLED_SHARDS * 5  # never more files than the sampled shards


def test_held_out_reading_stops_once_the_groups_of_a_source_are_full(tmp_path: Path):
    english = _source(tmp_path / "en", shards=4, per_shard=50)
    french = _source(tmp_path / "fr", shards=4, per_shard=50, language="fr")
    with open(english / "heldout" / f"00003{SHARD_SUFFIX}", "ab") as f:
        f.write(b"not zstd")  # after the shard's 50 documents: reached only if the reading went on
    per_doc = len(shard_records(english / "heldout" / f"00000{SHARD_SUFFIX}")[0]["text"])
    store = Store(str(tmp_path / "store"))
    curated = {"en": committed(store, english), "fr": committed(store, french)}
    groups = selection._heldout_by_group(curated, budget=1000)
    assert sorted(groups) == ["en", "fr"]
    assert all(len(docs) == -(-1000 // per_doc) for docs in groups.values())  # up to the budget, then stopped


def test_a_selection_without_a_bpe_candidate_reads_no_training_text(tmp_path: Path):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from compass.specs.how import How
    from compass.tasks.steps.context import Runtime, StepContext

    source = _source(tmp_path / "en", shards=2, per_shard=20)
    for shard in (source / "train").iterdir():
        shard.write_bytes(b"not zstd")  # any read of the training split fails
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator(["shard doc word"] * 10, trainers.BpeTrainer(vocab_size=300,
                                                                         special_tokens=["<|endoftext|>"]))
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>").save_pretrained(str(tmp_path / "mine"))
    config = selection.TokenizerConfig(candidates=[{"kind": "local", "name": "mine", "path": str(tmp_path / "mine")}])
    out = tmp_path / "out"
    out.mkdir()
    curated = committed(Store(str(tmp_path / "store")), source)
    ctx = StepContext("tokenizer", "select", config, {"curated:en": curated}, out, tmp_path / "s",
                      tmp_path / "w", Runtime(how=How(), base_dir=tmp_path), logging.getLogger("test"))
    result = selection.run_tokenizer_selection(ctx)
    assert result.metrics["chosen"] == "mine" and result.metrics["mean_fertility"] > 0
