"""Mixtral: the Llama block (Mistral's attention, sliding window included) with a sparse mixture of
SiLU-gated experts in place of the MLP; the top-k routing probabilities are renormalized to sum to 1.

The checkpoint calls the feed-forward `block_sparse_moe`; it is the `mlp` here, like every family's."""

from __future__ import annotations

from torch import nn

from rill.shard.layers.moe import expert_checkpoint_name
from rill.shard.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaModel
from rill.shard.models.moe import MoeConfig, sparse_moe


class MixtralDecoderLayer(LlamaDecoderLayer):
    def make_mlp(self, config: MoeConfig, layer_id: int) -> nn.Module:
        return sparse_moe(config)


class MixtralModel(LlamaModel):
    layer_class: type[nn.Module] = MixtralDecoderLayer


class MixtralForCausalLM(LlamaForCausalLM):
    config_class: type = MoeConfig
    model_class: type[nn.Module] = MixtralModel

    @staticmethod
    def resolve_checkpoint_name(name: str) -> tuple[str, object] | None:
        renamed = name.replace(".block_sparse_moe.", ".mlp.")
        if renamed == name:
            return None
        return expert_checkpoint_name(renamed) or (renamed, None)
