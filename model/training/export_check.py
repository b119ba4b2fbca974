"""Every Hugging Face export proven to be the model that trained: converted weights that generate differently are
a recurring bug in every framework that converts (a key mapped wrong, a config field lost, tied weights untied).
Before the export, the training model scores a fixed batch through its engine (every rank joins: the weights may be
sharded); after it, the exported folder is loaded by transformers as a user would load it and scores the same
batch. A difference beyond the precision's tolerance fails the checkpoint's write, and so the step."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import torch

from compass.model.attention import takes_sequence_lengths
from compass.model.training.packing import PackedBatch, make_batch

PROBE_TOKENS = 64
TOLERANCE = {"fp32": 1e-4, "bf16": 3e-2, "fp16": 3e-2}  # relative, on the batch's mean cross-entropy


class ExportMismatch(RuntimeError):
    pass


def probe_batch(vocab_size: int, length: int) -> PackedBatch:
    """One document of fixed random tokens (no document boundaries: any attention kernel scores it alike)."""
    tokens = np.random.default_rng(0).integers(0, vocab_size, (1, min(PROBE_TOKENS, length)))
    return make_batch(tokens, np.zeros_like(tokens))


def trained_loss(model: Any, inputs: dict[str, Any], precision: Any) -> float:
    """The training model's mean cross-entropy on the batch's `inputs` (through its engine, under the trainer's
    `precision` context): one read from the device per export."""
    with torch.no_grad(), precision:
        return float(model(**inputs)[1])


def exported_loss(folder: Path, batch: PackedBatch) -> float:
    """The batch's mean cross-entropy under the exported folder, loaded by transformers in fp32 on the CPU."""
    from transformers import AutoModelForCausalLM

    from compass.model.lm import CausalLMWithLoss

    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    scorer = CausalLMWithLoss(model)
    lengths = takes_sequence_lengths(model.config._attn_implementation or "")
    with torch.no_grad():
        return float(scorer(**batch.inputs(torch.device("cpu"), lengths))[1])


def check_export(folder: Path, batch: PackedBatch, trained: float, precision: str) -> float:
    """The export's loss on `batch`, raising ExportMismatch unless it is the training model's (`trained`)."""
    got = exported_loss(folder, batch)
    if not math.isclose(got, trained, rel_tol=TOLERANCE[precision]):
        raise ExportMismatch(f"{folder}: the exported model scores {got:.6f} on a fixed batch where the training "
                             f"model scored {trained:.6f} ({precision}): the export is not the trained model (a "
                             "weight mapped wrong, a config field lost); nothing was committed")
    return got
