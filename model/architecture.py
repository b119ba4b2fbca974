"""Build the decoder `what.architecture` describes from transformers model classes (no downloads).

- dense, no qk-norm: SmolLM3 (per-layer RoPE/NoPE via `no_rope_layers`, so rope, nope and rnope all fit);
- dense with qk-norm: Qwen3 (RoPE in every layer);
- moe: Qwen3-MoE (routed experts with load-balancing loss; q/k norms are part of that architecture).
The parameter count equals the planner's `specs.costs.count_parameters` (tested).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers import PretrainedConfig, PreTrainedModel

from compass.model.attention import DOCUMENT_SDPA, register
from compass.specs.architecture import Architecture


class ArchitectureNotSupported(ValueError):
    pass


def hf_config(arch: Architecture, vocab_size: int, special: dict[str, int], max_positions: int) -> PretrainedConfig:
    """A transformers config for the architecture; `special` holds bos/eos/pad token ids of our tokenizer."""
    common: dict[str, Any] = dict(
        vocab_size=vocab_size, hidden_size=arch.hidden_size, intermediate_size=arch.ffn_size,
        num_hidden_layers=arch.num_layers, num_attention_heads=arch.num_heads, num_key_value_heads=arch.num_kv_heads,
        head_dim=arch.resolved_head_dim, max_position_embeddings=max_positions, rms_norm_eps=arch.norm_eps,
        rope_theta=arch.positions.rope_theta, tie_word_embeddings=arch.tied_embeddings,
        initializer_range=arch.init_std, attention_dropout=arch.dropout, use_cache=False,
        bos_token_id=special["bos"], eos_token_id=special["eos"], pad_token_id=special["pad"],
    )
    if arch.family == "moe":
        from transformers import Qwen3MoeConfig

        if not arch.qk_norm or (arch.moe and arch.moe.shared_experts):
            raise ArchitectureNotSupported("MoE builds on Qwen3-MoE: it needs qk_norm: true and no shared experts")
        if arch.positions.kind != "rope":
            raise ArchitectureNotSupported("MoE builds on Qwen3-MoE, which has RoPE in every layer")
        moe = arch.moe
        return Qwen3MoeConfig(**common, moe_intermediate_size=moe.expert_ffn_size, num_experts=moe.num_experts,
                              num_experts_per_tok=moe.experts_per_token, router_aux_loss_coef=moe.load_balancing_coef,
                              output_router_logits=True, norm_topk_prob=True)
    if arch.qk_norm:
        from transformers import Qwen3Config

        if arch.positions.kind != "rope":
            raise ArchitectureNotSupported("qk_norm builds on Qwen3, which has RoPE in every layer")
        return Qwen3Config(**common)
    from transformers import SmolLM3Config

    return SmolLM3Config(**common, no_rope_layers=nope_pattern(arch), use_sliding_window=False)


def nope_pattern(arch: Architecture) -> list[int]:
    """SmolLM3's per-layer flags: 1 = RoPE, 0 = NoPE (rnope: every `nope_every`-th layer has no RoPE)."""
    pos = arch.positions
    if pos.kind == "rope":
        return [1] * arch.num_layers
    if pos.kind == "nope":
        return [0] * arch.num_layers
    return [0 if (i + 1) % pos.nope_every == 0 else 1 for i in range(arch.num_layers)]


def build_model(config: PretrainedConfig, seed: int, attn_implementation: str = DOCUMENT_SDPA) -> PreTrainedModel:
    """Initialise from one seed: every data-parallel rank builds identical weights."""
    from transformers import AutoModelForCausalLM


    register()
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation)
    model.config.use_cache = False
    return model


def load_pretrained(folder: Path, max_positions: int, rope_theta: float,
                    attn_implementation: str = DOCUMENT_SDPA) -> PreTrainedModel:
    """A starting checkpoint as the trainer trains it: its own model class and config in fp32, at least the
    recipe's context, and the recipe's RoPE base (long context from a checkpoint raises it)."""
    from transformers import AutoConfig, AutoModelForCausalLM


    register()
    config = AutoConfig.from_pretrained(str(folder))
    config.max_position_embeddings = max(max_positions, config.max_position_embeddings)
    rope = getattr(config, "rope_parameters", None)
    if isinstance(rope, dict) and rope.get("rope_theta") != rope_theta:
        rope["rope_theta"] = rope_theta
    if getattr(config, "rope_theta", None) not in (None, rope_theta):
        config.rope_theta = rope_theta
    config.use_cache = False
    return AutoModelForCausalLM.from_pretrained(str(folder), config=config, dtype=torch.float32,
                                                attn_implementation=attn_implementation)


def parameter_groups(model: torch.nn.Module, weight_decay: float, decay_embeddings: bool) -> list[dict[str, Any]]:
    """AdamW groups: no decay on norms and biases, nor on embeddings unless the spec asks for it."""
    decay, no_decay = [], []
    embeddings = {id(p) for m in model.modules() if isinstance(m, torch.nn.Embedding) for p in m.parameters()}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if p.ndim < 2 or "norm" in name or (id(p) in embeddings and not decay_embeddings):
            no_decay.append(p)
        else:
            decay.append(p)
    return [{"params": decay, "weight_decay": weight_decay, "name": "decay"},
            {"params": no_decay, "weight_decay": 0.0, "name": "no_decay"}]
