"""LoRA through peft on a TRL method: only the adapters train, the exported
model is full weights with the adapter merged, and the adapter kept beside them reproduces that export exactly when
merged into the model the step started from. QLoRA is refused on CPU with a clear error."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import run_up_to, seeded, write_minimal_spec

SFT_LORA = """  post_training:
    - {method: sft, name: sft_lora, dataset: "pypi://evals==3.0.1.post1", lr: 1.0e-3, max_samples: 32,
       max_length: 256, batch_size: 8, peft: {kind: lora, r: 4, alpha: 8, target_modules: [q_proj, v_proj]}}
  pretraining:"""


@pytest.mark.slow
def test_lora_sft_exports_merged_weights_and_its_adapter(trained_store: Path, tmp_path: Path):
    import torch
    from peft import PeftModel
    from safetensors.torch import load_file

    from compass.tasks.post_training.chat import load_chat_model

    spec = write_minimal_spec(tmp_path, **{"  pretraining:": SFT_LORA})
    plan, outcomes = run_up_to(spec, "post_train:sft_lora", seeded(tmp_path / "store", trained_store))
    lora = outcomes["post_train:sft_lora"]
    out = Path(lora.uri)
    metrics = lora.manifest.metrics
    assert metrics["peft"] == "lora" and 0 < metrics["trainable_parameters"] < metrics["total_parameters"] / 5
    assert {"adapter_config.json", "adapter_model.safetensors"} <= {p.name for p in (out / "adapter").iterdir()}

    exported = load_file(str(out / "final" / "model.safetensors"))
    assert not [k for k in exported if "lora" in k or "trainable_tokens" in k]  # plain full weights
    previous = Path(outcomes[plan.step("post_train:sft_lora").inputs["previous"]].uri) / "final"
    before = load_file(str(previous / "model.safetensors"))
    changed = {k for k in before if k in exported  # (the embeddings grew by the chat tokens: their old rows)
               and not torch.equal(before[k], exported[k][: before[k].shape[0]])}
    assert changed and all("q_proj" in k or "v_proj" in k for k in changed), sorted(changed)  # only what LoRA adapts

    # the adapter merged into the step's starting model (the chat tokens added to it the same way every time)
    base, _ = load_chat_model(previous)
    merged = PeftModel.from_pretrained(base, str(out / "adapter")).merge_and_unload().state_dict()
    for key, value in exported.items():
        assert torch.allclose(merged[key], value, atol=1e-6), key


def test_qlora_on_cpu_is_refused_with_a_hint(tmp_path: Path):
    from compass.specs.loader import SpecError

    spec = write_minimal_spec(tmp_path, **{"  pretraining:": SFT_LORA.replace("kind: lora", "kind: qlora")})
    with pytest.raises(SpecError) as raised:
        from compass.flows.validation import load_checked

        load_checked(spec, machine=False)
    (problem,) = [p for p in raised.value.problems if "qlora" in str(p)]
    text = str(problem)
    assert "what.post_training[0].peft.kind" in text and "use kind: lora on CPU" in text and ":" in text
