"""`what.architecture`: the decoder the run trains (dense or MoE, attention layout, positions, stability)."""

from collections.abc import Iterator
from typing import Literal

from pydantic import Field, PositiveFloat, PositiveInt

from compass.specs.base import Issue, Loc, SpecModel


class MoE(SpecModel):
    """Mixture-of-experts feed-forward layers (Qwen3-MoE style)."""

    num_experts: PositiveInt = Field(description="Routed experts per MoE layer.")
    experts_per_token: PositiveInt = Field(description="Top-k experts each token is routed to.")
    expert_ffn_size: PositiveInt = Field(description="Hidden size of each expert's FFN.")
    shared_experts: int = Field(default=0, ge=0, description="Always-active experts (0 = none).")
    load_balancing_coef: float = Field(default=0.01, ge=0, description="Auxiliary load-balancing loss weight.")


class Positions(SpecModel):
    """Positional encoding: RoPE everywhere, NoPE everywhere, or the RoPE/NoPE hybrid (rnope)."""

    kind: Literal["rope", "nope", "rnope"] = Field(
        default="rope", description="rope: RoPE in every layer; nope: no positional encoding; rnope: no RoPE in every "
                                    "nope_every-th layer (SmolLM3).")
    rope_theta: PositiveFloat = Field(default=10_000.0, description="RoPE base frequency.")
    nope_every: PositiveInt | None = Field(
        default=None, description="rnope only: every k-th layer has no positional encoding (SmolLM3: 4)."
    )


class Architecture(SpecModel):
    """Decoder-only transformer, described by the numbers that fix its parameter count."""

    family: Literal["dense", "moe"] = Field(
        default="dense", description="dense: one FFN per layer; moe: mixture-of-experts FFNs (Qwen3-MoE: needs the "
                                     "moe section and qk_norm).")
    num_layers: PositiveInt = Field(description="Number of decoder layers.")
    hidden_size: PositiveInt = Field(description="Width of the residual stream (the embedding size).")
    ffn_size: PositiveInt = Field(description="Intermediate size of the gated (SwiGLU) FFN.")
    num_heads: PositiveInt = Field(description="Attention (query) heads per layer.")
    num_kv_heads: PositiveInt = Field(description="= num_heads for MHA, 1 for MQA, in between for GQA.")
    head_dim: PositiveInt | None = Field(default=None, description="Defaults to hidden_size / num_heads.")
    vocab_size: PositiveInt | None = Field(
        default=None, description="Fixed vocabulary size; left empty, the chosen tokenizer decides."
    )
    positions: Positions = Field(default=Positions(), description="Positional encoding of the attention layers.")
    tied_embeddings: bool = Field(
        default=True, description="Share one matrix between the input embeddings and the output head.")
    qk_norm: bool = Field(
        default=False, description="RMSNorm on queries and keys (builds on Qwen3, which needs RoPE in every layer).")
    z_loss: float = Field(default=0.0, ge=0, description="z-loss coefficient (0 = off).")
    embedding_weight_decay: bool = Field(
        default=False, description="Apply weight decay to embeddings (the playbook turns it off)."
    )
    norm_eps: PositiveFloat = Field(default=1e-6, description="Epsilon of the RMSNorm layers.")
    dropout: float = Field(default=0.0, ge=0, lt=1,
                           description="Dropout probability on the attention weights (0 = none).")
    init_std: PositiveFloat = Field(
        default=0.02, description="Standard deviation of the normal initialisation of random weights.")
    moe: MoE | None = Field(
        default=None, description="Mixture-of-experts layers: required with family moe, refused with dense.")

    @property
    def resolved_head_dim(self) -> int:
        return self.head_dim or self.hidden_size // self.num_heads


def architecture_rules(a: Architecture, at: Loc) -> Iterator[Issue]:
    """What makes an architecture buildable and sound (the main model's, or an ablation variant's proxy)."""
    if a.num_kv_heads > a.num_heads or a.num_heads % a.num_kv_heads:
        divisors = [d for d in range(1, a.num_heads + 1) if a.num_heads % d == 0]
        yield Issue((*at, "num_kv_heads"), f"num_kv_heads={a.num_kv_heads} must divide num_heads={a.num_heads}",
                    f"use one of {divisors} (1 = MQA, {a.num_heads} = MHA)")
    if a.head_dim is None and a.hidden_size % a.num_heads:
        yield Issue((*at, "hidden_size"), f"hidden_size={a.hidden_size} is not divisible by num_heads={a.num_heads}",
                    "change one of them, or set head_dim explicitly")
    if a.resolved_head_dim % 2:
        yield Issue((*at, "head_dim"), f"head_dim={a.resolved_head_dim} must be even for RoPE",
                    "pick an even head dimension")
    pos = a.positions
    if pos.kind == "rnope" and pos.nope_every is None:
        yield Issue((*at, "positions", "nope_every"), "rnope needs nope_every",
                    "SmolLM3 uses nope_every: 4 (every 4th layer without RoPE)")
    if pos.kind == "rnope" and pos.nope_every is not None and pos.nope_every < 2:
        yield Issue((*at, "positions", "nope_every"), "nope_every must be at least 2 for a hybrid",
                    "use kind: nope for no positional encoding at all")
    if pos.kind != "rnope" and pos.nope_every is not None:
        yield Issue((*at, "positions", "nope_every"), f"nope_every only applies to kind: rnope, not {pos.kind}",
                    "remove nope_every or set kind: rnope")
    if a.family == "moe" and a.moe is None:
        yield Issue((*at, "family"), "family: moe needs a moe block",
                    "add moe: {num_experts, experts_per_token, expert_ffn_size}")
    if a.family == "dense" and a.moe is not None:
        yield Issue((*at, "moe"), "a moe block on a dense model", "set family: moe or remove the block")
    if a.moe and a.moe.experts_per_token > a.moe.num_experts:
        yield Issue((*at, "moe", "experts_per_token"),
                    f"experts_per_token={a.moe.experts_per_token} exceeds num_experts={a.moe.num_experts}",
                    "route to at most num_experts experts")
    if a.family == "moe" and a.moe and a.moe.shared_experts:
        yield Issue((*at, "moe", "shared_experts"), "MoE builds on Qwen3-MoE, which has no shared experts",
                    "set shared_experts: 0")
    if a.family == "moe" and a.moe and not a.qk_norm:
        yield Issue((*at, "qk_norm"), "MoE builds on Qwen3-MoE, whose attention has q/k norms",
                    "set qk_norm: true")
    if (a.family == "moe" and a.moe or a.qk_norm) and pos.kind != "rope":
        yield Issue((*at, "positions", "kind"), f"{'MoE' if a.family == 'moe' else 'qk_norm'} builds on Qwen3, "
                    f"which has RoPE in every layer, not {pos.kind}", "use positions.kind: rope")
