"""Tokenizing a source is streamed: a curated source of 64 MiB of text (2 shards) and one of 192 MiB (6 shards) are
tokenized by the step and its datatrove worker processes; the larger source peaks no higher than the smaller one
(a small constant times one batch, not a multiple of the source: the step once held a whole source's text in a
list, which would add 128 MiB, six times the margin allowed), and neither peaks over 0.5 GB (~0.15 GB measured).
The token shards hold every document, each ending with EOS, one shard per curated shard."""

from __future__ import annotations

import json
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from compass.infra.store import Store
from tests.conftest import REPO
from tests.shards import SHARD_SUFFIX, compress
from tests.test_data_scale_tokenizer import committed

SHARD_CHARS = 2**25 + 1  # 32 MiB of text per shard
SMALL, LARGE = 2, 6  # shards: 64 MiB and 192 MiB of text
DOC_WORDS = 2000

# Peaks are each process's VmHWM (the high-water mark of its own memory map), this process's and its descendants'
# sampled while they run. Not ru_maxrss: Linux carries it across exec, so a child forked from a large parent (a
# pytest worker holding torch) reports the parent's size.
MEASURE = """
import json, logging, sys, threading, time
from pathlib import Path
import psutil
from compass.infra.store import Store
from compass.tasks.kinds.encode_tokens import tokenize_curated
from compass.tasks.steps.context import InputArtifact, Runtime, StepContext
from compass.tasks.steps.step_config import EmptyConfig

def hwm_kib(pid):
    try:
        with open(f"/proc/{pid}/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))
    except (OSError, StopIteration):
        return 0

peak = {"kib": 0}
seen = set()
done = threading.Event()
def sample():
    while not done.is_set():
        pids = [c.pid for c in psutil.Process().children(recursive=True)]
        seen.update(pids)
        peak["kib"] = max([peak["kib"], hwm_kib("self"), *(hwm_kib(p) for p in pids)])
        time.sleep(0.1)
sampler = threading.Thread(target=sample, daemon=True)
sampler.start()
store = Store(sys.argv[2])
curated = InputArtifact("curated", "curate:big", sys.argv[3], store.read_manifest(sys.argv[3]), store)
work = Path(sys.argv[5])
ctx = StepContext("tokenize", "big", EmptyConfig(), {}, Path(sys.argv[4]), work, work, Runtime(),
                  logging.getLogger("measure"), store=store)
counts = tokenize_curated(Path(sys.argv[1]), curated, ctx)
done.set()
sampler.join()
print(json.dumps({**counts, "peak_kib": max(peak["kib"], hwm_kib("self")), "processes": len(seen)}))
"""


def _tokenizer(folder: Path, words: list[str]) -> None:
    """A word-level tokenizer over the generated words: what is measured is the streaming around the tokenizer
    (reading, batching, writing shards), and a word-level model gets 256 MiB through two cores in half a minute, not
    the quarter of an hour a byte-level BPE takes here."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<|endoftext|>": 0, "<unk>": 1, **{w: i + 2 for i, w in enumerate(sorted(set(words)))}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", unk_token="<unk>").save_pretrained(
        str(folder))


@pytest.mark.slow
def test_tokenizing_three_times_the_text_does_not_raise_the_peak_memory(tmp_path: Path):
    rng = random.Random(0)
    words = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 9))) for _ in range(5000)]
    _tokenizer(tmp_path / "tokenizer", words)
    documents, chars = [], 0
    while chars < SHARD_CHARS:
        text = " ".join(rng.choice(words) for _ in range(DOC_WORDS))
        documents.append(json.dumps({"text": text}))
        chars += len(text)
    shard = tmp_path / f"shard{SHARD_SUFFIX}"
    shard.write_bytes(compress(("\n".join(documents) + "\n").encode()))
    peaks = {}
    for shards in (SMALL, LARGE):
        folder = tmp_path / f"source-{shards}"
        curated = folder / "curated"
        (curated / "train").mkdir(parents=True)
        (curated / "heldout").mkdir()
        for i in range(shards):  # the same shard again: what is measured is the reading, not the generating
            shutil.copy(shard, curated / "train" / f"{i:05d}{SHARD_SUFFIX}")
        (curated / "heldout" / f"00000{SHARD_SUFFIX}").write_bytes(compress((documents[0] + "\n").encode()))
        (folder / "tokens").mkdir()
        try:
            peaks[shards] = _check(folder, tmp_path / "tokenizer", committed(Store(str(folder / "store")), curated).uri,
                                   shards, len(documents))
        finally:  # hundreds of MB of shards and tokens: not left to pytest's kept temporary folders
            for big in ("store", "tokens", "work", "curated"):
                shutil.rmtree(folder / big, ignore_errors=True)
    assert LARGE * chars >= 3 * 2**26  # 192 MiB of text went through the larger run
    # 128 MiB more text, the same peak (a whole-source list would add 128 MiB). 40 MB covers the jitter: +6 to +8 MB
    # on an idle machine, +20.4 MB once in a loaded suite (each worker tokenizes 3 shards, not 1)
    assert peaks[LARGE] < peaks[SMALL] + 40e6, {k: f"{v / 1e9:.3f} GB" for k, v in peaks.items()}


def _check(folder: Path, tokenizer: Path, uri: str, shards: int, shard_documents: int) -> float:
    """Tokenize the committed source at `uri` in a process of its own; its peak memory (bytes) and its checks."""
    done = subprocess.run([sys.executable, "-c", MEASURE, str(tokenizer), str(folder / "store"), uri,
                           str(folder / "tokens"), str(folder / "work")], cwd=REPO, capture_output=True, text=True,
                          timeout=1200)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["train_documents"] == shards * shard_documents and result["heldout_documents"] == 1
    assert result["processes"] >= 3  # measured: the datatrove workers, not this process alone
    assert result["peak_kib"] * 1024 < 0.5e9, f"peak RSS {result['peak_kib'] / 2**20:.2f} GiB"
    from compass.model.training.token_files import TokenizedSource

    source = TokenizedSource(folder / "tokens")
    assert len(source.shards) == shards and source.n_documents == shards * shard_documents
    assert source.n_tokens == result["train_tokens"]
    first = [source.document(i) for i in range(shard_documents)]
    per_shard = sum(len(d) for d in first)  # every shard tokenizes alike: the shards are copies
    assert source.n_tokens == shards * per_shard
    for i in (0, shard_documents - 1, shard_documents, shards * shard_documents - 1):  # across shard boundaries
        document = source.document(i)
        assert (document == first[i % shard_documents]).all()
        assert document[-1] == source.eos and not (document[:-1] == source.eos).any()
    return result["peak_kib"] * 1024
