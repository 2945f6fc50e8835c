"""Gemma 2: the Llama block with GeGLU, (1 + w) RMSNorms, embeddings scaled by sqrt(hidden_size), norms
after attention and around the MLP, attention scaled by `query_pre_attn_scalar`, attention and final logits
soft-capped, and a sliding window on the layers `layer_types` marks (every other one).

The (1 + w) of Gemma's norms is stored at load (`GemmaRMSNorm`'s weight loader), so the shared RMSNorm and
its kernels run unchanged.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from rill.shard.layers.attention import PagedAttention
from rill.shard.layers.linear import MergedColumnParallelLinear, RowParallelLinear, copy_into, read_part
from rill.shard.layers.norm import RMSNorm
from rill.shard.models.llama import LlamaAttention, LlamaConfig, LlamaForCausalLM, LlamaModel

# Layer i is windowed when (i + 1) % period != 0, for configs written before transformers had `layer_types`.
SLIDING_PERIOD = {"gemma2": 2, "gemma3_text": 6}


@dataclass(frozen=True)
class GemmaConfig(LlamaConfig):
    query_pre_attn_scalar: float = 0.0
    attn_logit_softcapping: float = 0.0  # 0: none
    final_logit_softcapping: float = 0.0  # 0: none
    local_rope_theta: float = 0.0  # rope theta of the windowed layers (Gemma 3); 0: rope_theta

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> GemmaConfig:
        normalized = dict(hf)
        rope = hf.get("rope_parameters") or {}
        local_rope_theta = float(hf.get("rope_local_base_freq") or 0.0)
        if "full_attention" in rope:  # transformers 5 Gemma 3: rope parameters per layer type
            normalized["rope_parameters"] = rope["full_attention"]
            local = rope.get("sliding_attention") or {}
            if local.get("rope_type", "default") != "default":
                raise ValueError(f"unsupported rope_type {local['rope_type']!r} on Gemma's sliding layers")
            local_rope_theta = float(local.get("rope_theta", local_rope_theta))
        if hf.get("layer_types") is None and hf.get("sliding_window"):
            period = hf.get("sliding_window_pattern") or SLIDING_PERIOD[hf["model_type"]]
            normalized["layer_types"] = [
                "sliding_attention" if (i + 1) % period else "full_attention"
                for i in range(hf["num_hidden_layers"])
            ]
        normalized["hidden_act"] = hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh"
        base = LlamaConfig.from_hf(normalized)
        return cls(
            **{field.name: getattr(base, field.name) for field in dataclasses.fields(LlamaConfig)},
            query_pre_attn_scalar=float(hf.get("query_pre_attn_scalar") or base.head_dim),
            attn_logit_softcapping=float(hf.get("attn_logit_softcapping") or 0.0),
            final_logit_softcapping=float(hf.get("final_logit_softcapping") or 0.0),
            local_rope_theta=local_rope_theta,
        )


class GemmaRMSNorm(RMSNorm):
    """RMSNorm whose checkpoint weight w means a scale of (1 + w)."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__(hidden_size, eps)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: Any, shard_id: object = None) -> None:
        assert shard_id is None, f"unexpected shard id {shard_id!r} for a norm"
        copy_into(param.data, read_part(loaded).float().add(1.0).to(param.dtype))


class GemmaMLP(nn.Module):
    def __init__(self, config: GemmaConfig) -> None:
        super().__init__()
        if config.hidden_act not in ("gelu_pytorch_tanh", "gelu"):
            raise ValueError(
                f"unsupported hidden_activation {config.hidden_act!r} (supported: gelu_pytorch_tanh)"
            )
        self.approximate = "tanh" if config.hidden_act == "gelu_pytorch_tanh" else "none"
        size = config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, {0: size, 1: size})
        self.down_proj = RowParallelLinear(size, config.hidden_size)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj.split(self.gate_up_proj(hidden))
        return self.down_proj(nn.functional.gelu(gate, approximate=self.approximate) * up)


class Gemma2Attention(LlamaAttention):
    def __init__(self, config: GemmaConfig, layer_id: int) -> None:
        super().__init__(config, layer_id)
        self.attn = PagedAttention(
            layer_id,
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            config.query_pre_attn_scalar**-0.5,
            sliding_window=config.layer_windows[layer_id],
            softcap=config.attn_logit_softcapping,
        )


class Gemma2DecoderLayer(nn.Module):
    attention_class: type[nn.Module] = Gemma2Attention

    def __init__(self, config: GemmaConfig, layer_id: int) -> None:
        super().__init__()
        self.self_attn = self.attention_class(config, layer_id)
        self.mlp = GemmaMLP(config)
        size, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(size, eps)
        self.post_attention_layernorm = GemmaRMSNorm(size, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(size, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(size, eps)

    def forward(
        self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """As LlamaDecoderLayer: the block's output is `hidden + residual` of what it returns."""
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.post_attention_layernorm(self.self_attn(positions, hidden))
        hidden, residual = self.pre_feedforward_layernorm(hidden, residual)
        return self.post_feedforward_layernorm(self.mlp(hidden)), residual


class Gemma2Model(LlamaModel):
    layer_class: type[nn.Module] = Gemma2DecoderLayer

    def __init__(self, config: GemmaConfig) -> None:
        super().__init__(config)
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.embed_scale = math.sqrt(config.hidden_size)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        hidden = hidden * torch.tensor(self.embed_scale, dtype=hidden.dtype)
        residual = None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class Gemma2ForCausalLM(LlamaForCausalLM):
    config_class: type = GemmaConfig
    model_class: type[nn.Module] = Gemma2Model

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden)
        cap = self.config.final_logit_softcapping
        return logits if cap == 0.0 else torch.tanh(logits / cap) * cap
