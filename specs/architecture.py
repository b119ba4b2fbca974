"""`what.architecture`: the decoder the run trains (dense or MoE, attention layout, positions, stability)."""

from typing import Literal

from pydantic import Field, PositiveFloat, PositiveInt

from compass.specs.base import SpecModel


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
