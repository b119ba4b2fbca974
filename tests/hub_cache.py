"""A dataset in the Hugging Face hub cache's own layout, as `hf download --repo-type dataset` leaves it: how a
user brings a standard lighteval task's data to a machine without network."""

from __future__ import annotations

from pathlib import Path
from typing import Any

COMMIT = "c0" * 20


def seed_dataset(cache: Path, repo: str, subset: str, splits: dict[str, Any]) -> Path:
    """Write `splits` (name -> datasets.Dataset) as parquet under the repo's snapshot; returns the snapshot."""
    folder = cache / f"datasets--{repo.replace('/', '--')}"
    snapshot = folder / "snapshots" / COMMIT
    (snapshot / subset).mkdir(parents=True, exist_ok=True)
    files = []
    for split, data in splits.items():
        data.to_parquet(str(snapshot / subset / f"{split}-00000-of-00001.parquet"))
        files.append(f"  - split: {split}\n    path: {subset}/{split}-*\n")
    (snapshot / "README.md").write_text(f"---\nconfigs:\n- config_name: {subset}\n  data_files:\n{''.join(files)}---\n")
    (folder / "refs").mkdir(exist_ok=True)
    (folder / "refs" / "main").write_text(COMMIT)
    return snapshot


def seed_model(cache: Path, repo: str, files: Path) -> Path:
    """Place the files of `files` (a folder) as the snapshot of model repo `repo`, as `hf download REPO` would."""
    import shutil

    folder = cache / f"models--{repo.replace('/', '--')}"
    snapshot = folder / "snapshots" / COMMIT
    shutil.copytree(files, snapshot)
    (folder / "refs").mkdir(parents=True, exist_ok=True)
    (folder / "refs" / "main").write_text(COMMIT)
    return snapshot


def tiny_llama(folder: Path) -> Path:
    """A small random Llama with a BPE tokenizer trained on the fixture corpus, saved to `folder` (an "existing
    model" for tests that must not download one)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    corpus = Path(__file__).parent / "fixtures" / "corpus"
    texts = [p.read_text() for p in sorted(corpus.rglob("*.txt"))]
    bpe = Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>", "<s>", "</s>"],
                                                                     initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                                        pad_token="</s>")
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                                         max_position_embeddings=512,
                                         bos_token_id=1, eos_token_id=2, pad_token_id=2))
    model.save_pretrained(str(folder), safe_serialization=True)
    tokenizer.save_pretrained(str(folder))
    return folder


def llama_like_tokenizer(folder: Path) -> Path:
    """A byte-level BPE trained here (~850 tokens), saved as the hub repository the spec names holds its tokenizer: a
    stand-in a smoke run reports in its table (the spec declares Llama 3's 128,256)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    texts = [p.read_text() for p in sorted((Path(__file__).parent / "fixtures" / "corpus").rglob("*.*"))]
    special = ["<|begin_of_text|>", "<|end_of_text|>"]
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=2000, special_tokens=special,
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=special[0], eos_token=special[1]).save_pretrained(
        str(folder))
    return folder


SMOLLM3_BASE = {  # SmolLM3-3B-Base's config.json, the fields that matter (its weights are not needed to plan)
    "architectures": ["SmolLM3ForCausalLM"], "model_type": "smollm3", "hidden_size": 2048, "intermediate_size": 11008,
    "num_hidden_layers": 36, "num_attention_heads": 16, "num_key_value_heads": 4, "vocab_size": 128256,
    "max_position_embeddings": 65536, "rope_theta": 5000000.0, "rms_norm_eps": 1e-06, "tie_word_embeddings": True,
    "no_rope_layers": [0 if (i + 1) % 4 == 0 else 1 for i in range(36)], "initializer_range": 0.02,
}


def seed_smollm3_base(cache: Path, files: Path) -> Path:
    """SmolLM3-3B-Base as `hf download` leaves it, its config only: what specs/examples/smollm3-finetune.yaml reads
    to plan (its architecture; no weights are loaded before training)."""
    import json

    files.mkdir(parents=True, exist_ok=True)
    (files / "config.json").write_text(json.dumps(SMOLLM3_BASE))
    return seed_model(cache, "HuggingFaceTB/SmolLM3-3B-Base", files)
