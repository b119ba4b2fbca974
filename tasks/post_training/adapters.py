"""LoRA and QLoRA for every TRL method (peft): the step trains adapters on the model it continues, then exports
full weights with the adapter merged in (what inference engines load) and keeps the adapter beside them.

The model is saved as it enters training (after the chat tokens are added) and the adapter is merged into that
saved copy in full precision: with QLoRA the trained base is a 4-bit copy that cannot take a merge."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from compass.specs.post_training import Lora
from compass.tasks.common.devices import Device


def with_adapters(model: Any, lora: Lora, base_dir: Path, where: Device) -> Any:
    """The model to train: adapters on `model` (lora), or on a 4-bit copy of it loaded from `base_dir`, where the
    step saved it (qlora). Embeddings are not adapted: chat tokens a base model lacked keep their initial rows
    (the mean of the others), so adapt a model that has them, or fine-tune fully first."""
    from peft import LoraConfig, get_peft_model

    if lora.kind == "qlora":
        model = _four_bit(base_dir, where)
    config = LoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout, task_type="CAUSAL_LM",
                        target_modules=lora.target_modules)
    return get_peft_model(model, config)


def _four_bit(base_dir: Path, where: Device) -> Any:
    """The saved model quantised to 4 bits (NF4) for QLoRA; bitsandbytes and CUDA only, imported here."""
    import torch
    from peft import prepare_model_for_kbit_training
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    if where.device != "cuda":
        raise RuntimeError("qlora needs CUDA (bitsandbytes 4-bit kernels); use peft.kind: lora on CPU")
    quantized = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                   bnb_4bit_compute_dtype=torch.bfloat16)
    model = AutoModelForCausalLM.from_pretrained(str(base_dir), quantization_config=quantized, device_map={"": 0})
    return prepare_model_for_kbit_training(model)


def export_merged(adapter: Path, base_dir: Path, out: Path, adapter_out: Path) -> Any:
    """Keep the trained adapter (saved in `adapter`) in `adapter_out`, merge it into the full-precision base and
    write that to `out`; returns the merged model."""

    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    shutil.copytree(adapter, adapter_out, dirs_exist_ok=True)
    base = AutoModelForCausalLM.from_pretrained(str(base_dir))
    merged = PeftModel.from_pretrained(base, str(adapter_out)).merge_and_unload()
    merged.config.use_cache = False
    merged.save_pretrained(str(out), safe_serialization=True)
    return merged
