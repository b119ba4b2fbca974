"""A Hugging Face causal LM and its training loss in one module: the decoder's hidden states go straight into the
chunked (or fused) loss, so no full-vocabulary logits exist, and DDP and DeepSpeed see the loss computed inside
the forward they wrap. The Hugging Face model stays an attribute (`hf`): checkpoints export it as is."""

from __future__ import annotations

from typing import Any

import torch

from compass.model.attention import forward_kwargs
from compass.model.loss import chunked_lm_loss, liger_lm_loss, recomputed_lm_loss

LOSSES = {"chunked": chunked_lm_loss, "liger": liger_lm_loss, "recomputed": recomputed_lm_loss}


class CausalLMWithLoss(torch.nn.Module):
    def __init__(self, hf: torch.nn.Module, z_loss: float = 0.0, moe_coef: float = 0.0, loss: str = "chunked"):
        super().__init__()
        self.hf = hf
        self.config = hf.config  # what DeepSpeed's AutoTP reads the tensor-parallel plan from
        self.z_loss = z_loss
        self.moe_coef = moe_coef
        self.loss = loss

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, labels: torch.Tensor,
                **attention: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """(loss to optimise, cross-entropy) of a packed batch; the MoE load-balancing term joins the loss.
        `attention`: what the attention backend reads besides position ids (flash's sequence lengths)."""
        moe = self.moe_coef > 0
        kwargs = {"output_router_logits": True} if moe else {}
        attention = {**forward_kwargs(self.hf.config._attn_implementation, self.training), **attention}
        out = self.hf.model(input_ids=input_ids, position_ids=position_ids, use_cache=False, **kwargs, **attention)
        head = self.hf.get_output_embeddings()
        loss, ce = LOSSES[self.loss](out.last_hidden_state, labels, head, self.z_loss)
        if moe:
            from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

            config = self.hf.config
            aux = load_balancing_loss_func(out.router_logits, config.num_experts, config.num_experts_per_tok)
            loss = loss + self.moe_coef * aux
        return loss, ce
