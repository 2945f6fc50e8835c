"""Rill's Llama-family decoder (llama, mistral, qwen2): pure math over flattened tokens and a paged KV cache.

Inputs are the flattened tokens of every sequence in the call, `input_ids` and `positions` of shape
[num_tokens]; attention metadata comes from the forward context (rill.shard.layers.attention). A sliding
window applies where the config has one: to every layer (Mistral, Phi-3), or to the layers `layer_types`
marks "sliding_attention" (Qwen2 with `use_sliding_window`).

Other families reuse these blocks: a family file subclasses the attention, MLP or decoder layer it changes
and names its classes through the `*_class` attributes below.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from rill.shard.layers.activation import SiluAndMul
from rill.shard.layers.attention import PagedAttention
from rill.shard.layers.decoder_stack import StackLayer
from rill.shard.layers.embedding import Embedding, LMHead
from rill.shard.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from rill.shard.layers.norm import RMSNorm
from rill.shard.layers.rotary import RotaryEmbedding


@dataclass(frozen=True)
class LlamaConfig:
    """The architecture fields Rill reads from a Hugging Face config.json (transformers 4 or 5 layout)."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_proj_bias: bool
    mlp_bias: bool
    hidden_act: str
    # Per layer: the sliding window in tokens (0: the layer attends to every earlier position).
    layer_windows: tuple[int, ...]

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> LlamaConfig:
        model_type = hf["model_type"]
        num_heads = hf["num_attention_heads"]
        # transformers 5 folds rope_theta and the scaling into `rope_parameters`; 4 has them at top level.
        rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
        rope_theta = float(rope.pop("rope_theta", hf.get("rope_theta", 10000.0)))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        attention_bias = bool(hf.get("attention_bias", False))
        max_position_embeddings = hf.get("max_position_embeddings", 2048)
        rope_scaling = None
        if rope_type != "default":
            rope_scaling = {
                "original_max_position_embeddings": hf.get("original_max_position_embeddings"),
                **rope,
                "rope_type": rope_type,
                "max_position_embeddings": max_position_embeddings,
            }
        if float(rope.get("partial_rotary_factor", hf.get("partial_rotary_factor") or 1.0)) != 1.0:
            raise ValueError(
                "partial_rotary_factor below 1 (Phi-4-mini, some GPT-NeoX-style models) is not supported"
            )
        return cls(
            model_type=model_type,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_hidden_layers=hf["num_hidden_layers"],
            num_attention_heads=num_heads,
            num_key_value_heads=hf.get("num_key_value_heads") or num_heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // num_heads,
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=max_position_embeddings,
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            # Qwen2 always has q/k/v bias and no o_proj bias; Llama's `attention_bias` covers all four.
            qkv_bias=True if model_type == "qwen2" else attention_bias,
            o_proj_bias=False if model_type == "qwen2" else attention_bias,
            mlp_bias=bool(hf.get("mlp_bias", False)),
            hidden_act=hf.get("hidden_act", "silu"),
            layer_windows=layer_windows(hf),
        )


def layer_windows(hf: dict[str, Any]) -> tuple[int, ...]:
    """Each layer's sliding window from an HF config: `layer_types` when present, else `sliding_window` on
    every layer (Mistral, Phi-3); Qwen2/3 windows only with `use_sliding_window`."""
    num_layers = hf["num_hidden_layers"]
    window = hf.get("sliding_window") or 0
    if hf.get("use_sliding_window") is False:
        window = 0
    layer_types = hf.get("layer_types")
    if layer_types is None:
        return (window,) * num_layers
    if len(layer_types) != num_layers:
        raise ValueError(f"layer_types has {len(layer_types)} entries for {num_layers} layers")
    unknown = set(layer_types) - {"sliding_attention", "full_attention"}
    if unknown:
        raise ValueError(
            f"unsupported layer_types {sorted(unknown)} (supported: sliding_attention, full_attention)"
        )
    return tuple(window if kind == "sliding_attention" else 0 for kind in layer_types)


class LlamaAttention(nn.Module):
    def __init__(self, config: LlamaConfig, layer_id: int) -> None:
        super().__init__()
        self.head_dim = config.head_dim
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size,
            self.head_dim,
            config.num_attention_heads,
            config.num_key_value_heads,
            bias=config.qkv_bias,
        )
        # This rank's share of the heads (all of them on a single shard).
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.o_proj = RowParallelLinear(
            config.num_attention_heads * self.head_dim, config.hidden_size, bias=config.o_proj_bias
        )
        self.rotary_emb = RotaryEmbedding(self.head_dim, config.rope_theta, config.rope_scaling)
        self.attn = PagedAttention(
            layer_id,
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            self.head_dim**-0.5,
            sliding_window=config.layer_windows[layer_id],
        )

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv_proj.split(self.qkv_proj(hidden))
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        q, k = self.rotary_emb(positions, q, k)
        out = self.attn(q, k, v)
        return self.o_proj(out.flatten(1))


class LlamaMLP(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        if config.hidden_act != "silu":
            raise ValueError(f"unsupported hidden_act {config.hidden_act!r} (supported: silu)")
        size = config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(
            config.hidden_size, {0: size, 1: size}, bias=config.mlp_bias
        )
        self.down_proj = RowParallelLinear(size, config.hidden_size, bias=config.mlp_bias)
        self.act = SiluAndMul()

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(hidden)))


class LlamaDecoderLayer(nn.Module):
    attention_class: type[nn.Module] = LlamaAttention
    mlp_class: type[nn.Module] = LlamaMLP

    def __init__(self, config: LlamaConfig, layer_id: int) -> None:
        super().__init__()
        self.self_attn = self.attention_class(config, layer_id)
        self.mlp = self.make_mlp(config, layer_id)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def make_mlp(self, config: LlamaConfig, layer_id: int) -> nn.Module:
        return self.mlp_class(config)

    def block_parts(self) -> StackLayer | None:
        """This layer's modules as a standard pre-norm block (rill.shard.layers.decoder_stack), or None where
        a family's subclass computes anything else: its forward, its attention's or its MLP's is not
        Llama's."""
        attention, mlp = self.self_attn, self.mlp
        if (
            type(self).forward is not LlamaDecoderLayer.forward
            or type(attention).forward is not LlamaAttention.forward
            or type(mlp).forward is not LlamaMLP.forward
            or any(
                type(norm).forward is not RMSNorm.forward
                for norm in (self.input_layernorm, self.post_attention_layernorm)
            )
        ):
            return None
        return StackLayer(
            input_norm=self.input_layernorm,
            qkv=attention.qkv_proj,
            rotary=attention.rotary_emb,
            attention=attention.attn,
            o_proj=attention.o_proj,
            post_norm=self.post_attention_layernorm,
            gate_up=mlp.gate_up_proj,
            act=mlp.act,
            down=mlp.down_proj,
        )

    def forward(
        self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Pre-norm block with the residual stream carried apart, so each add fuses into the next norm:
        the block's output is `hidden + residual` of what it returns (residual None: all in hidden)."""
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaModel(nn.Module):
    """Embedding, the decoder layers, the final norm."""

    layer_class: type[nn.Module] = LlamaDecoderLayer

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(self.layer_class(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class LlamaForCausalLM(nn.Module):
    """`forward` returns final hidden states [num_tokens, hidden]; `compute_logits` maps chosen rows to
    float32 logits [rows, vocab], so the LM head runs only on the rows that are sampled."""

    config_class: type = LlamaConfig
    model_class: type[nn.Module] = LlamaModel
    # How the checkpoint's names map to the parameters (rill.shard.weights.CheckpointLayout).
    packed_modules_mapping: dict[str, tuple[str, object]] = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }
    fused_checkpoint_parts: dict[str, list[tuple[object, int]]] = {}

    @staticmethod
    def resolve_checkpoint_name(name: str) -> tuple[str, object] | None:
        return None

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        self.model = self.model_class(config)
        self.lm_head = LMHead(config.vocab_size, config.hidden_size)
        if config.tie_word_embeddings:
            self.lm_head.tie_to(self.model.embed_tokens)
        # KV heads this model instance holds (its rank's share under tensor parallelism).
        self.num_kv_heads: int = self.model.layers[0].self_attn.num_kv_heads

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)
