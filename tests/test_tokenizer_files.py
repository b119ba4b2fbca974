"""The tokenize step reads the end-of-document id with tokenizers alone (tasks/data/tokenizer_files.eos_id): the id
transformers resolves, in a folder saved by transformers, in one whose special_tokens_map.json names another token
than its tokenizer_config.json (the map wins), and (through transformers) for a token the vocabulary lacks."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from compass.tasks.data.tokenizer_files import eos_id, tokenizer_ids
from tests.hub_cache import llama_like_tokenizer


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return llama_like_tokenizer(tmp_path_factory.mktemp("tokenizer") / "saved")


def _copy(saved: Path, folder: Path, config: dict | None = None, special_map: dict | None = None) -> Path:
    shutil.copytree(saved, folder)
    if config is not None:
        (folder / "tokenizer_config.json").write_text(json.dumps(config))
    if special_map is not None:
        (folder / "special_tokens_map.json").write_text(json.dumps(special_map))
    return folder


def test_the_eos_id_is_the_one_transformers_reads_in_a_saved_folder(saved: Path):
    assert eos_id(saved) == tokenizer_ids(saved).eos == 1  # <|end_of_text|>, the second special token


def test_the_special_tokens_map_names_the_eos_over_the_tokenizer_config(saved: Path, tmp_path: Path):
    config = json.loads((saved / "tokenizer_config.json").read_text())
    legacy = {k: v for k, v in config.items() if k != "added_tokens_decoder"}
    folder = _copy(saved, tmp_path / "legacy", legacy, {"eos_token": {"content": "<|begin_of_text|>"}})
    assert eos_id(folder) == tokenizer_ids(folder).eos == 0
    modern = _copy(saved, tmp_path / "modern", config, {"eos_token": "<|begin_of_text|>"})
    assert eos_id(modern) == tokenizer_ids(modern).eos == 0
    no_map = _copy(saved, tmp_path / "no-map", {**config, "eos_token": "<|begin_of_text|>"})
    (no_map / "special_tokens_map.json").unlink(missing_ok=True)
    assert eos_id(no_map) == tokenizer_ids(no_map).eos == 0


def test_an_eos_the_vocabulary_lacks_is_resolved_by_transformers(saved: Path, tmp_path: Path):
    config = json.loads((saved / "tokenizer_config.json").read_text())
    folder = _copy(saved, tmp_path / "added", {**config, "eos_token": "<|not_in_the_vocabulary|>"})
    assert eos_id(folder) == tokenizer_ids(folder).eos
