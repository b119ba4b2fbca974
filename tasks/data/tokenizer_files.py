"""What training and the data steps read from a Hugging Face tokenizer folder: the files that make one, and the
ids training needs (end of document, padding, embedding size)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


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
