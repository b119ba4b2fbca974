"""The planner's arithmetic: exact parameter counts (checked against transformers) and SmolLM3 by hand."""

from pathlib import Path

import pytest
import torch
from transformers import (
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
    SmolLM3Config,
    SmolLM3ForCausalLM,
)

from compass.specs import costs, load_spec
from compass.specs.architecture import Architecture

EXAMPLES = Path(__file__).parent.parent / "specs" / "examples"


@pytest.fixture(scope="module")
def smollm3():
    return load_spec(EXAMPLES / "smollm3-3b.yaml").spec


def numel(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def test_parameter_count_matches_transformers_smollm3_tied():
    arch = Architecture(num_layers=3, hidden_size=96, ffn_size=200, num_heads=6, num_kv_heads=2,
                        positions={"kind": "rnope", "nope_every": 3}, tied_embeddings=True)
    config = SmolLM3Config(vocab_size=500, hidden_size=96, intermediate_size=200, num_hidden_layers=3,
                           num_attention_heads=6, num_key_value_heads=2, tie_word_embeddings=True,
                           no_rope_layer_interval=3, pad_token_id=0, bos_token_id=1, eos_token_id=1)
    assert costs.count_parameters(arch, 500).total == numel(SmolLM3ForCausalLM(config))


def test_parameter_count_matches_transformers_qwen3_untied_qk_norm():
    arch = Architecture(num_layers=2, hidden_size=64, ffn_size=160, num_heads=4, num_kv_heads=1, head_dim=32,
                        tied_embeddings=False, qk_norm=True)
    config = Qwen3Config(vocab_size=300, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=1, head_dim=32, tie_word_embeddings=False)
    assert costs.count_parameters(arch, 300).total == numel(Qwen3ForCausalLM(config))


def test_parameter_count_matches_transformers_moe():
    arch = Architecture(family="moe", num_layers=2, hidden_size=64, ffn_size=128, num_heads=4, num_kv_heads=2,
                        qk_norm=True, tied_embeddings=False,
                        moe={"num_experts": 4, "experts_per_token": 2, "expert_ffn_size": 48})
    config = Qwen3MoeConfig(vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=48,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                            num_experts=4, num_experts_per_tok=2, tie_word_embeddings=False)
    count = costs.count_parameters(arch, 256)
    assert count.total == numel(Qwen3MoeForCausalLM(config))
    assert count.active_non_embedding == count.non_embedding - 2 * 2 * (3 * 64 * 48)  # 2 layers x 2 idle experts


def test_smollm3_parameters_by_hand(smollm3):
    d, f, layers, vocab = 2048, 11008, 36, 128256
    per_layer = d * d * 2 + d * 512 * 2 + 3 * d * f + 2 * d  # q,o + k,v (4 KV heads x 128) + SwiGLU + 2 norms
    count = costs.count_parameters(smollm3.what.architecture, vocab)
    assert count.embedding == vocab * d == 262_668_288
    assert count.non_embedding == layers * per_layer + d == 2_812_430_336
    assert count.total == pytest.approx(3.08e9, rel=0.01)  # "SmolLM3-3B: 3.08B parameters"


def test_smollm3_training_compute_by_hand(smollm3):
    n_matmul = 36 * (2048 * 2048 * 2 + 2048 * 512 * 2 + 3 * 2048 * 11008) + 128256 * 2048
    per_token = 6 * n_matmul + 12 * 36 * 16 * 128 * 4096
    stages = {s.name: s for s in costs.stage_costs(smollm3)}
    assert stages["stage1"].flops == pytest.approx(per_token * 8.1396e12, rel=1e-9)  # 3,450,000 steps of 2.36M
    total_pretrain = sum(s.flops for s in costs.stage_costs(smollm3) if s.section == "pretrain")
    assert total_pretrain == pytest.approx(6 * 3.08e9 * 11.1e12, rel=0.25)  # attention adds ~20% at 4k
    hours = sum(s.gpu_hours for s in costs.stage_costs(smollm3) if s.section in ("pretrain", "long_context"))
    # published: ~24 days on 384 H100s = ~221k GPU-hours; at the spec's 30% MFU the estimate is within ~10%
    assert hours == pytest.approx(384 * 24 * 24, rel=0.10)


def test_smollm3_kv_cache_by_hand(smollm3):
    kv = {k.seq_len: k for k in costs.kv_cache(smollm3)}
    assert kv[4096].bytes_gqa == 2 * 36 * 4 * 128 * 2 * 4096  # ~302 MB
    assert kv[65536].bytes_mha == 4 * kv[65536].bytes_gqa     # GQA with 4 of 16 heads: 4x smaller


def test_memory_by_zero_stage(smollm3):
    n = costs.count_parameters(smollm3.what.architecture, 128256).total
    tp, dp = 2, 192
    z0, z1, z2, z3 = (costs.memory_per_gpu(smollm3, z) for z in range(4))
    assert z0.weights == pytest.approx(2 * n / tp)
    assert z0.optimizer == pytest.approx(12 * n / tp)
    assert z1.optimizer == pytest.approx(12 * n / tp / dp)
    # gradients summed in fp32 (how.reduce_precision): a whole fp32 accumulator beside the bf16 gradients at ZeRO-1
    # (DeepSpeed's BF16_Optimizer), fp32 partitions from ZeRO-2 up
    assert z1.gradients == pytest.approx(6 * n / tp)
    assert z2.gradients == pytest.approx(4 * n / tp / dp)
    low = smollm3.model_copy(update={"how": smollm3.how.model_copy(update={"reduce_precision": "bf16"})})
    assert costs.memory_per_gpu(low, 1).gradients == pytest.approx(2 * n / tp)
    assert z3.weights == pytest.approx(2 * n / tp / dp)
    assert z0.total > z1.total > z2.total > z3.total
    # the example recomputes activations: each layer keeps its input, one layer's 34 sbh are live at a time; tensor
    # parallelism without sequence parallelism splits 24 of the 34 (attention and MLP), not the layer inputs
    assert z0.activations == pytest.approx((36 * 2 + 10 + 24 / tp) * 4096 * 3 * 2048)
    full = smollm3.model_copy(update={"how": smollm3.how.model_copy(update={
        "parallelism": smollm3.how.parallelism.model_copy(update={"activation_checkpointing": False})})})
    assert costs.memory_per_gpu(full, 0).activations == pytest.approx(36 * (10 + 24 / tp) * 4096 * 3 * 2048)


def test_ablation_cost_counts_every_run(smollm3):
    abl = costs.ablation_cost(smollm3)
    assert abl.runs == (3 + 1) * 1
    proxy = Architecture.model_validate({**smollm3.what.architecture.model_dump(), "num_layers": 16,
                                         "ffn_size": 8192})
    expected = 4 * costs.flops_per_token(proxy, 128256, 4096) * 45e9
    assert abl.flops == pytest.approx(expected)
    assert 0 < abl.share_of_main < 0.05


def test_cpu_device_memory_is_read_from_this_machine():
    import psutil

    from compass.specs.costs import device_memory_bytes
    from compass.specs.how import How

    assert device_memory_bytes(How()) == psutil.virtual_memory().total  # not a constant: the machine's own
    h100 = How.model_validate({"hardware": {"accelerator": "h100"}})
    assert device_memory_bytes(h100) == 80 * 2**30
