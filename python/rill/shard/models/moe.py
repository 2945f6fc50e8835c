"""The configuration of the Llama-family mixture-of-experts models (Mixtral, Qwen3-MoE) and their sparse MoE
feed-forward, shared by their model files."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from rill.shard.layers.moe import SparseMoE
from rill.shard.models.llama import LlamaConfig


@dataclass(frozen=True)
class MoeConfig(LlamaConfig):
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    normalize_top_k: bool = True
    # Layers with a sparse MoE feed-forward (the others keep a dense MLP of `intermediate_size`).
    sparse_layers: tuple[int, ...] = ()

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> MoeConfig:
        base = LlamaConfig.from_hf(hf)
        num_layers = hf["num_hidden_layers"]
        if hf["model_type"] == "mixtral":
            sparse_layers, normalize = tuple(range(num_layers)), True
        else:  # qwen3_moe
            step = hf.get("decoder_sparse_step") or 1
            dense = set(hf.get("mlp_only_layers") or [])
            sparse_layers = tuple(i for i in range(num_layers) if i not in dense and (i + 1) % step == 0)
            normalize = bool(hf.get("norm_topk_prob", False))
        return cls(
            **{field.name: getattr(base, field.name) for field in dataclasses.fields(LlamaConfig)},
            num_experts=hf.get("num_local_experts") or hf["num_experts"],
            num_experts_per_tok=hf["num_experts_per_tok"],
            moe_intermediate_size=hf.get("moe_intermediate_size") or hf["intermediate_size"],
            normalize_top_k=normalize,
            sparse_layers=sparse_layers,
        )


def sparse_moe(config: MoeConfig) -> SparseMoE:
    return SparseMoE(
        config.hidden_size,
        config.moe_intermediate_size,
        config.num_experts,
        config.num_experts_per_tok,
        config.normalize_top_k,
    )
