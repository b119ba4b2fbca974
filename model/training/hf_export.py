"""A trained model written as a Hugging Face folder (config, safetensors, tokenizer) that transformers loads as is."""

from __future__ import annotations

import shutil
import socket
from pathlib import Path

import torch

from compass.infra.layout import REQUIRED_TOKENIZER_FILES, TOKENIZER_FILES


def export_hf(model: torch.nn.Module, state: dict[str, torch.Tensor] | None, tokenizer_dir: Path,
              out: Path) -> list[Path]:
    """A Hugging Face folder (config, safetensors, tokenizer) that transformers loads as is; `state` None: the
    weights are in `out` already (written from the shards). The tokenizer must be complete where the rank runs: an
    export without it would load in nothing, so a missing file fails the step."""
    missing = [name for name in REQUIRED_TOKENIZER_FILES if not (tokenizer_dir / name).exists()]
    if missing:
        raise FileNotFoundError(f"the tokenizer at {tokenizer_dir} has no {', '.join(missing)} on "
                                f"{socket.gethostname()}: the exported checkpoint would not load. Under a cluster the "
                                "tokenizer must be under how.orchestration.cluster.shared_root, where every node sees "
                                "it")
    if state is None:
        model.config.save_pretrained(str(out))
        if model.generation_config is not None:
            model.generation_config.save_pretrained(str(out))
    else:
        model.save_pretrained(str(out), state_dict=state, safe_serialization=True)
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).exists():
            shutil.copy(tokenizer_dir / name, out / name)
    return sorted(p for p in out.rglob("*") if p.is_file())  # only rank 0 writes here
