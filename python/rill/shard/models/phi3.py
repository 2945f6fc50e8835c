"""Phi-3 (and Phi-4 with full rotary): the Llama block, whose checkpoints store q/k/v as one `qkv_proj`
tensor and gate/up as one `gate_up_proj` tensor.

Rill's fused layers split by tensor-parallel rank within each part, so a checkpoint's fused tensor is cut
back into its parts at load (`fused_checkpoint_parts`, read by rill.shard.weights) and each part goes to the
layer's `weight_loader` under its shard id, as separate q/k/v tensors would.
"""

from __future__ import annotations

from rill.shard.models.llama import LlamaConfig, LlamaForCausalLM


class Phi3ForCausalLM(LlamaForCausalLM):
    packed_modules_mapping: dict[str, tuple[str, object]] = {}

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__(config)
        q_rows = config.num_attention_heads * config.head_dim
        kv_rows = config.num_key_value_heads * config.head_dim
        # Fused checkpoint tensor -> its parts in row order: (shard id, rows).
        self.fused_checkpoint_parts: dict[str, list[tuple[object, int]]] = {
            "qkv_proj": [("q", q_rows), ("k", kv_rows), ("v", kv_rows)],
            "gate_up_proj": [(0, config.intermediate_size), (1, config.intermediate_size)],
        }
