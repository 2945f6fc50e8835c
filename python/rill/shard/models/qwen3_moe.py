"""Qwen3-MoE: Qwen3's attention (per-head q/k norm) with a sparse mixture of experts on the layers
`decoder_sparse_step` / `mlp_only_layers` choose (a dense MLP on the others); the top-k routing
probabilities are renormalized only when `norm_topk_prob` is set."""

from __future__ import annotations

from torch import nn

from rill.shard.layers.moe import expert_checkpoint_name
from rill.shard.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaModel
from rill.shard.models.moe import MoeConfig, sparse_moe
from rill.shard.models.qwen3 import Qwen3Attention


class Qwen3MoeDecoderLayer(LlamaDecoderLayer):
    attention_class: type[nn.Module] = Qwen3Attention

    def make_mlp(self, config: MoeConfig, layer_id: int) -> nn.Module:
        return sparse_moe(config) if layer_id in config.sparse_layers else self.mlp_class(config)


class Qwen3MoeModel(LlamaModel):
    layer_class: type[nn.Module] = Qwen3MoeDecoderLayer


class Qwen3MoeForCausalLM(LlamaForCausalLM):
    config_class: type = MoeConfig
    model_class: type[nn.Module] = Qwen3MoeModel

    @staticmethod
    def resolve_checkpoint_name(name: str) -> tuple[str, object] | None:
        return expert_checkpoint_name(name)
