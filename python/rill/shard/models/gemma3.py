"""Gemma 3 (text): Gemma 2's block with a (1 + w) RMSNorm over each query and key head, and its own rope
theta (`rope_local_base_freq`, no scaling) on the sliding-window layers; usually 5 windowed layers to 1
global one, and no attention soft-capping (final logits are soft-capped when the config says so)."""

from __future__ import annotations

import torch
from torch import nn

from rill.shard.layers.norm import norm_heads
from rill.shard.layers.rotary import RotaryEmbedding
from rill.shard.models.gemma2 import (
    Gemma2Attention,
    Gemma2DecoderLayer,
    Gemma2ForCausalLM,
    Gemma2Model,
    GemmaConfig,
    GemmaRMSNorm,
)


class Gemma3Attention(Gemma2Attention):
    def __init__(self, config: GemmaConfig, layer_id: int) -> None:
        super().__init__(config, layer_id)
        # Gemma 3 configs carry `attn_logit_softcapping`, but transformers' Gemma 3 never applies it.
        self.attn.softcap = 0.0
        self.q_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps)
        if config.layer_windows[layer_id] and config.local_rope_theta:
            self.rotary_emb = RotaryEmbedding(self.head_dim, config.local_rope_theta, None)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv_proj.split(self.qkv_proj(hidden))
        q = norm_heads(self.q_norm, q.view(-1, self.num_heads, self.head_dim))
        k = norm_heads(self.k_norm, k.view(-1, self.num_kv_heads, self.head_dim))
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(self.attn(q, k, v).flatten(1))


class Gemma3DecoderLayer(Gemma2DecoderLayer):
    attention_class: type[nn.Module] = Gemma3Attention


class Gemma3Model(Gemma2Model):
    layer_class: type[nn.Module] = Gemma3DecoderLayer


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    model_class: type[nn.Module] = Gemma3Model
