"""What training and the data steps read from a Hugging Face tokenizer folder: the files that make one, and the
ids training needs (end of document, padding, embedding size)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from compass.tasks.steps.kind import IMPORTING


@dataclass(frozen=True)
class TokenizerIds:
    """What training needs from the chosen tokenizer: its end-of-document and padding ids, and the size of the
    embedding (the largest id plus one, added tokens included)."""

    eos: int
    pad: int
    vocab_size: int


def tokenizer_ids(folder: Path) -> TokenizerIds:
    """Read from a Hugging Face tokenizer folder (ours, a local one, or a hub snapshot); the padding id falls back
    to the end-of-document id."""
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast.from_pretrained(str(folder))
    if tok.eos_token_id is None:
        raise ValueError(f"the tokenizer in {folder} has no end-of-sequence token: set eos_token in its "
                         "tokenizer_config.json")
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    return TokenizerIds(tok.eos_token_id, pad, max(tok.get_vocab().values()) + 1)


def eos_id(folder: Path) -> int:
    """The end-of-document id, resolved as transformers resolves it (special_tokens_map.json's eos_token, else
    tokenizer_config.json's: tests/test_tokenizer_files.py compares them) but read with tokenizers alone: the
    tokenize step then needs no model library, whose import cost a cold process 4-5 s. A token the vocabulary
    lacks (transformers would add it) is left to tokenizer_ids."""
    from tokenizers import Tokenizer

    token = (_json(folder / "special_tokens_map.json").get("eos_token")
             or _json(folder / "tokenizer_config.json").get("eos_token"))
    if isinstance(token, dict):
        token = token.get("content")
    found = Tokenizer.from_file(str(folder / "tokenizer.json")).token_to_id(token) if isinstance(token, str) else None
    if found is not None:
        return found

    with IMPORTING:  # transformers' lazy names, imported by one thread at a time
        return tokenizer_ids(folder).eos


def _json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}
    return data if isinstance(data, dict) else {}
