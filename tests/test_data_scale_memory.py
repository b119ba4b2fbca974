"""Tokenizing a source is streamed: a curated source of 2 GiB of text (20 shards) is tokenized in a process whose
peak memory stays under 1.5 GB, a small constant times one batch, not a multiple of the source (the step once
held a whole source's text in a list). The token files hold every document, each ending with EOS."""

from __future__ import annotations

import gzip
import json
import random
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from compass.infra.store import Store
from tests.conftest import REPO
from tests.test_data_scale_tokenizer import committed

SHARDS = 20
SHARD_CHARS = 2**30 // 10 + 1  # 20 shards of ~107 MB: 2 GiB of text in all
DOC_WORDS = 2000

MEASURE = """
import json, resource, sys
from pathlib import Path
from compass.infra.store import Store
from compass.tasks.kinds.encode_tokens import tokenize_curated
from compass.tasks.steps.context import InputArtifact

store = Store(sys.argv[2])
curated = InputArtifact("curated", "curate:big", sys.argv[3], store.read_manifest(sys.argv[3]), store)
counts = tokenize_curated(Path(sys.argv[1]), curated, Path(sys.argv[4]))
print(json.dumps({**counts, "peak_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}))
"""


def _tokenizer(folder: Path, words: list[str]) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([" ".join(words[i: i + 50]) for i in range(0, len(words), 50)],
                            trainers.BpeTrainer(vocab_size=2000, special_tokens=["<|endoftext|>"]))
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>").save_pretrained(str(folder))


@pytest.mark.slow
def test_tokenizing_2_gib_of_text_keeps_peak_memory_under_1_5_gb(tmp_path: Path):
    rng = random.Random(0)
    words = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 9))) for _ in range(5000)]
    _tokenizer(tmp_path / "tokenizer", words)
    curated = tmp_path / "curated"
    (curated / "train").mkdir(parents=True)
    (curated / "heldout").mkdir()
    documents, chars = [], 0
    while chars < SHARD_CHARS:
        text = " ".join(rng.choice(words) for _ in range(DOC_WORDS))
        documents.append(json.dumps({"text": text}))
        chars += len(text)
    with gzip.open(curated / "train" / "00000.jsonl.gz", "wt", compresslevel=1) as f:
        f.write("\n".join(documents) + "\n")
    for i in range(1, SHARDS):  # the same shard again: what is measured is the reading, not the generating
        shutil.copy(curated / "train" / "00000.jsonl.gz", curated / "train" / f"{i:05d}.jsonl.gz")
    with gzip.open(curated / "heldout" / "00000.jsonl.gz", "wt") as f:
        f.write(documents[0] + "\n")
    (tmp_path / "tokens").mkdir()

    try:
        _check(tmp_path, committed(Store(str(tmp_path / "store")), curated).uri, len(documents), chars)
    finally:  # 3 GB of shards and tokens: not left to pytest's kept temporary folders
        shutil.rmtree(tmp_path / "store")
        shutil.rmtree(tmp_path / "tokens")


def _check(tmp_path: Path, uri: str, shard_documents: int, chars: int) -> None:
    done = subprocess.run([sys.executable, "-c", MEASURE, str(tmp_path / "tokenizer"), str(tmp_path / "store"), uri,
                           str(tmp_path / "tokens")], cwd=REPO, capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert SHARDS * chars >= 2**31  # 2 GiB of text went through
    assert result["train_documents"] == SHARDS * shard_documents and result["heldout_documents"] == 1
    assert result["peak_kib"] * 1024 < 1.5e9, f"peak RSS {result['peak_kib'] / 2**20:.2f} GiB"
    offsets = np.load(tmp_path / "tokens" / "train.offsets.npy", mmap_mode="r")
    tokens = np.memmap(tmp_path / "tokens" / "train.tokens", dtype=np.uint16, mode="r")
    assert offsets[-1] == len(tokens) == result["train_tokens"]
    per_shard = int(offsets[shard_documents])  # every shard tokenizes alike: the shards are copies
    assert int(offsets[-1]) == SHARDS * per_shard
    eos = tokens[offsets[1:] - 1]
    assert (eos == eos[0]).all() and not (tokens[: offsets[1] - 1] == eos[0]).any()
