"""Qwen3: the Llama block with an RMSNorm over each query and key head before rotary, and no q/k/v bias.

The norms' weight has one entry per head dimension, shared by every head, so tensor parallelism needs
nothing new: each rank normalizes its own heads.
"""

from __future__ import annotations

import torch
from torch import nn

from rill.shard.layers.norm import RMSNorm, norm_heads
from rill.shard.models.llama import (
    LlamaAttention,
    LlamaConfig,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaModel,
)


class Qwen3Attention(LlamaAttention):
    def __init__(self, config: LlamaConfig, layer_id: int) -> None:
        super().__init__(config, layer_id)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv_proj.split(self.qkv_proj(hidden))
        q = norm_heads(self.q_norm, q.view(-1, self.num_heads, self.head_dim))
        k = norm_heads(self.k_norm, k.view(-1, self.num_kv_heads, self.head_dim))
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(self.attn(q, k, v).flatten(1))


class Qwen3DecoderLayer(LlamaDecoderLayer):
    attention_class = Qwen3Attention


class Qwen3Model(LlamaModel):
    layer_class = Qwen3DecoderLayer


class Qwen3ForCausalLM(LlamaForCausalLM):
    model_class: type[nn.Module] = Qwen3Model
