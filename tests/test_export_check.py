"""Every checkpoint's Hugging Face export is checked against the training model (model/training/export_check.py):
the export loaded by transformers scores a fixed batch as the training model did, and an export whose weights or
config differ fails the write."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from compass.model.training.export_check import ExportMismatch, check_export, probe_batch


def test_a_faithful_export_passes_and_a_corrupted_one_is_caught(tmp_path: Path):
    from compass.model.architecture import build_model, hf_config
    from compass.model.lm import CausalLMWithLoss
    from compass.model.training.hf_export import export_hf
    from compass.specs.architecture import Architecture
    from tests.hub_cache import tiny_llama

    tokenizer = tiny_llama(tmp_path / "tokenizer")  # a complete tokenizer folder to export with
    arch = Architecture(num_layers=2, hidden_size=32, ffn_size=64, num_heads=4, num_kv_heads=2, init_std=0.3)
    hf = build_model(hf_config(arch, 400, {"bos": 1, "eos": 2, "pad": 2}, 128), 5)
    batch = probe_batch(400, 128)
    with torch.no_grad():
        trained = float(CausalLMWithLoss(hf)(**batch.inputs(torch.device("cpu")))[1])
    export_hf(hf, {k: v.clone() for k, v in hf.state_dict().items()}, tokenizer, tmp_path / "good")
    assert check_export(tmp_path / "good", batch, trained, "fp32") == pytest.approx(trained, rel=1e-6)

    swapped = {k: v.clone() for k, v in hf.state_dict().items()}  # two same-shape projections exchanged: it loads
    swapped["model.layers.0.self_attn.q_proj.weight"] = hf.state_dict()["model.layers.1.self_attn.q_proj.weight"]
    export_hf(hf, swapped, tokenizer, tmp_path / "swapped")
    with pytest.raises(ExportMismatch, match="the export is not the trained model"):
        check_export(tmp_path / "swapped", batch, trained, "fp32")
