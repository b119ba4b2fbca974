"""Every step that trains or evaluates on a GPU fits it, checked at validation (N4): compass's own training stages
did already; TRL's steps and the passkey evaluation were estimated by `compass plan` and never enforced, so the
SmolLM3 example's SFT (batch 128 x 65,536 tokens in one pass on one GPU, ~6,902 GiB by the estimate) validated and
would have died weeks into the run. The check needs no machine: a GPU's memory is its kind's."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from compass.flows.validation import check
from compass.specs import costs, load_spec
from compass.specs.loader import SpecError
from tests.conftest import REPO

EXAMPLE = REPO / "specs" / "examples" / "smollm3-3b.yaml"
FIXED = {  # the example's fix, after the published SmolLM3 SFT (64k packed rows, 8 GPUs, Liger): undone
    "batch_size: 128, max_length: 65536, micro_batch_size: 1}": "batch_size: 128, max_length: 65536}",
    "post_training: {nodes: 1, devices_per_node: 8}": "post_training: {devices_per_node: 1}",
    "  loss: liger   #": "  #",
}


@pytest.fixture(scope="module")
def hub(tmp_path_factory: pytest.TempPathFactory):
    from tests.hub_cache import llama_like_tokenizer, seed_model

    folder = tmp_path_factory.mktemp("hub")
    seed_model(folder / "cache", "meta-llama/Llama-3.2-1B", llama_like_tokenizer(folder / "tokenizer"))
    saved = os.environ.get("HF_HUB_CACHE")
    os.environ["HF_HUB_CACHE"] = str(folder / "cache")
    yield
    if saved is None:
        os.environ.pop("HF_HUB_CACHE", None)
    else:
        os.environ["HF_HUB_CACHE"] = saved


def test_the_shipped_example_plans_every_step_as_fitting_its_gpu(hub):
    loaded = load_spec(EXAMPLE)
    check(loaded, machine=False)
    device = costs.device_memory_bytes(loaded.spec.how)
    steps = {m.step: m for m in costs.library_step_memory(loaded.spec)}
    assert set(steps) == {"post_train:sft", "post_train:apo", "evaluate: passkey"}
    assert all(m.total <= device for m in steps.values()), {k: m.total / costs.GIB for k, m in steps.items()}
    assert (steps["post_train:sft"].ranks, steps["post_train:sft"].micro_batch) == (8, 1)
    assert all(e.total <= device for _, _, e in costs.training_memory(loaded.spec))


def test_the_example_with_its_former_sft_settings_is_refused_naming_the_step_estimate_and_fields(hub, tmp_path: Path):
    text = EXAMPLE.read_text()
    for fixed, former in FIXED.items():
        assert fixed in text, fixed
        text = text.replace(fixed, former)
    spec = tmp_path / "smollm3-3b.yaml"
    spec.write_text(text)
    with pytest.raises(SpecError) as refused:
        check(load_spec(spec), machine=False)  # no machine checks: planning the cluster's run from a laptop
    message = str(refused.value)
    assert "what.post_training[1].micro_batch_size" in message, message
    assert "post_train:sft needs ~6902 GiB per h100" in message and "128 rows of 65536 tokens" in message
    assert "more than its 80 GiB" in message and "set micro_batch_size" in message and "loss: liger" in message
    assert "post_train:apo" not in message  # it fits


def test_liger_holds_one_chunk_of_logits_not_the_batchs():
    tokens, vocab, hidden = 65536, 128256, 2048
    assert costs.fused_logits(tokens, vocab, hidden) == 2048 * vocab * 4  # 65536 / ceil(128256 / 2048) -> 2048
    assert costs.fused_logits(100, vocab, hidden) == 2 * vocab * 4  # ceil(100 / 63) -> 2 tokens a chunk
