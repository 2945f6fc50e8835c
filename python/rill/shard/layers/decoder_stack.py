"""A Llama-style decoder stack run as one CPU kernel call (`rill.kernels.cpu.decoder_stack`).

The model says which of its modules make each layer (`StackLayer`); this builds the kernel's stack from their
loaded, packed weights, where it can run: on one shard (no all-reduce to make between layers) with every
projection packed for the CPU kernels. Its forward reads the attention metadata from the forward context, as
`PagedAttention` does, and its output has the bits of the same layers run one module at a time.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from rill.kernels import cpu as cpu_kernels
from rill.shard import distributed
from rill.shard.layers.attention import PagedAttention, get_forward_context
from rill.shard.layers.linear import Linear
from rill.shard.layers.norm import RMSNorm


@dataclass(frozen=True)
class StackLayer:
    """One pre-norm layer: input_norm -> qkv -> rotary -> attention -> o_proj; post_norm -> gate_up ->
    SiLU-and-mul -> down, the residual added before each norm."""

    input_norm: RMSNorm
    qkv: Linear
    attention: PagedAttention
    o_proj: Linear
    post_norm: RMSNorm
    gate_up: Linear
    down: Linear


def _bias(linear: Linear) -> torch.Tensor | None:
    return None if linear.bias is None else linear.bias.data


class DecoderStack:
    def __init__(self, kernel_stack: Any) -> None:
        self.kernel_stack = kernel_stack

    @classmethod
    def for_cpu(cls, layers: list[StackLayer], final_norm: RMSNorm) -> DecoderStack | None:
        """The stack on the CPU kernels, or None where it cannot run (several shards, an unpacked weight)."""
        linears = [m for layer in layers for m in (layer.qkv, layer.o_proj, layer.gate_up, layer.down)]
        packed = all(m.packed is not None and m.packed.is_packed for m in linears)
        if distributed.get_world_size() != 1 or not layers or not packed:
            return None
        weights = [
            dict(
                input_norm=layer.input_norm.weight.data,
                qkv=layer.qkv.packed.tensor,
                qkv_bias=_bias(layer.qkv),
                o_proj=layer.o_proj.packed.tensor,
                o_proj_bias=_bias(layer.o_proj),
                post_norm=layer.post_norm.weight.data,
                gate_up=layer.gate_up.packed.tensor,
                gate_up_bias=_bias(layer.gate_up),
                down=layer.down.packed.tensor,
                down_bias=_bias(layer.down),
                sliding_window=layer.attention.sliding_window,
            )
            for layer in layers
        ]
        attention = layers[0].attention
        return cls(
            cpu_kernels.decoder_stack(
                weights,
                final_norm.weight.data,
                intermediate_size=layers[0].down.packed.in_features,
                num_heads=attention.num_heads,
                num_kv_heads=attention.num_kv_heads,
                head_dim=attention.head_dim,
                rms_norm_eps=final_norm.eps,
                scale=attention.scale,
            )
        )

    def __call__(
        self, hidden: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> torch.Tensor:
        """The embedded tokens [tokens, hidden] through every layer and the final norm; cos, sin [tokens,
        head_dim / 2] rotate every layer (one rotary table)."""
        ctx = get_forward_context()
        return self.kernel_stack.forward(
            hidden,
            positions,
            cos,
            sin,
            ctx.kv_cache.k,
            ctx.kv_cache.v,
            ctx.block_tables,
            ctx.cu_seqlens_q_tensor,
            ctx.slot_mapping,
        )
