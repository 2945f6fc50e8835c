"""Runs of standard pre-norm decoder layers executed as one CPU kernel call each
(`rill.kernels.cpu.decoder_stack`), installed onto a loaded model from outside by the runner; the model file
only states its math.

The protocol: a decoder layer that computes exactly the standard pre-norm block (below) says so by returning
its modules from `block_parts()` (a `StackLayer`), and None when it computes anything else (extra norms, a
mixture of experts, soft-capping). `fuse_decoder_layers` then replaces each run of consecutive such layers of
a model's layer list whose parts are on the CPU kernels (packed projections, one shard, the same rotary table
and shapes) by one `FusedDecoderLayers`, which takes and returns what a layer does — `(positions, hidden,
residual) -> (hidden, residual)` — with the bits of the same layers run one module at a time, without Python
between them (about 0.2 ms per layer on a 2-core machine). Any other layer runs as it is.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from rill.kernels import cpu as cpu_kernels
from rill.kernels.ops import KernelOps
from rill.shard import distributed
from rill.shard.layers.activation import SiluAndMul
from rill.shard.layers.attention import PagedAttention, get_forward_context
from rill.shard.layers.linear import Linear
from rill.shard.layers.lora import LoraStack
from rill.shard.layers.norm import RMSNorm
from rill.shard.layers.rotary import RotaryEmbedding


@dataclass(frozen=True)
class StackLayer:
    """The modules of one standard pre-norm layer, in the order it applies them: input_norm -> qkv -> rotary
    -> attention -> o_proj; post_norm -> gate_up -> act (SiLU-and-mul) -> down, the residual added before each
    norm (LlamaDecoderLayer.forward)."""

    input_norm: RMSNorm
    qkv: Linear
    rotary: RotaryEmbedding
    attention: PagedAttention
    o_proj: Linear
    post_norm: RMSNorm
    gate_up: Linear
    act: SiluAndMul
    down: Linear

    def weights(self) -> dict[str, Any]:
        """The kernel's view of this layer: each of `cpu_kernels.decoder_layer_fields()` by name (projections
        as packed, their LoRA stacks' `a` and `b`, absent biases and stacks None) and the sliding window."""
        tensors = {
            "input_norm": self.input_norm.weight.data,
            "post_norm": self.post_norm.weight.data,
        }
        for name in ("qkv", "o_proj", "gate_up", "down"):
            linear: Linear = getattr(self, name)
            assert linear.packed is not None, "fusable layers have packed projections"
            tensors[name] = linear.packed.tensor
            tensors[f"{name}_bias"] = None if linear.bias is None else linear.bias.data
            lora = linear.lora
            assert lora is None or isinstance(lora, LoraStack), f"{name}: unknown adapter product {lora!r}"
            tensors[f"{name}_lora_a"] = None if lora is None else lora.a
            tensors[f"{name}_lora_b"] = None if lora is None else lora.b
        fields = {name for name, _ in cpu_kernels.decoder_layer_fields()}
        assert fields == set(tensors), (
            f"the kernel's layer fields {sorted(fields)} differ from {sorted(tensors)}"
        )
        return {**tensors, "sliding_window": self.attention.sliding_window}


def _can_fuse(parts: StackLayer) -> bool:
    """On the CPU kernels in full (projections packed in their layout, or quantized matrices in a float32
    model), without soft-capping (the kernel has none)."""
    linears = (parts.qkv, parts.o_proj, parts.gate_up, parts.down)
    modules = (parts.input_norm, parts.rotary, parts.attention, parts.post_norm, parts.act, *linears)
    return (
        all(isinstance(m.ops, cpu_kernels.CpuOps) for m in modules)
        and all(
            m.packed is not None
            and (
                m.packed.tensor.dtype in cpu_kernels.linear_dtypes()
                or (m.packed.tensor.dtype == torch.uint8 and parts.input_norm.weight.dtype == torch.float32)
            )
            for m in linears
        )
        and parts.attention.softcap == 0.0
        and parts.input_norm.eps == parts.post_norm.eps
    )


def _same_shape(a: StackLayer, b: StackLayer) -> bool:
    """Whether b can join a's run: the kernel holds one set of shapes, one eps and one rotary table."""
    return (
        a.rotary.table() is b.rotary.table()
        and a.input_norm.eps == b.input_norm.eps
        and (a.attention.num_heads, a.attention.num_kv_heads, a.attention.head_dim, a.attention.scale)
        == (b.attention.num_heads, b.attention.num_kv_heads, b.attention.head_dim, b.attention.scale)
        and a.down.packed.in_features == b.down.packed.in_features
    )


class FusedDecoderLayers(nn.Module):
    """A run of fusable layers as one kernel call; the layers stay its children (their parameters and modules
    remain the model's)."""

    def __init__(self, layers: list[nn.Module], parts: list[StackLayer]) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layers)
        first = parts[0]
        self.cos_sin = first.rotary.cos_sin  # every layer of the run rotates by the same table
        self.layer_ids = [p.attention.layer_id for p in parts]
        self.kernel = cpu_kernels.decoder_stack(
            [p.weights() for p in parts],
            intermediate_size=first.down.packed.in_features,
            num_heads=first.attention.num_heads,
            num_kv_heads=first.attention.num_kv_heads,
            head_dim=first.attention.head_dim,
            rms_norm_eps=first.input_norm.eps,
            scale=first.attention.scale,
        )

    def forward(
        self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        ctx = get_forward_context()
        cos, sin = self.cos_sin(positions, hidden.dtype)
        cache = ctx.kv_cache
        return self.kernel.forward(
            hidden,
            residual,
            positions,
            cos,
            sin,
            [cache.k[i] for i in self.layer_ids],
            [cache.v[i] for i in self.layer_ids],
            ctx.meta.block_tables,
            ctx.meta.cu_seqlens_q,
            ctx.meta.slot_mapping,
            ctx.lora_slots,
            [cache.k_scale[i] for i in self.layer_ids] if cache.is_int8 else [],
            [cache.v_scale[i] for i in self.layer_ids] if cache.is_int8 else [],
        )


def fuse_decoder_layers(model: nn.Module, ops: KernelOps | None) -> int:
    """Replaces every run of fusable layers in `model`'s layer lists (a `ModuleList` whose layers have
    `block_parts`) by a `FusedDecoderLayers`, once the kernel ops are installed; returns how many layers it
    fused. Nothing happens without the CPU kernels or on several shards (the kernel makes no all-reduce)."""
    if not isinstance(ops, cpu_kernels.CpuOps) or distributed.get_world_size() != 1:
        return 0
    num_fused = 0
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if not isinstance(child, nn.ModuleList) or not any(hasattr(m, "block_parts") for m in child):
                continue
            units: list[nn.Module] = []
            run: list[tuple[nn.Module, StackLayer]] = []
            for layer in [*child, None]:
                parts = layer.block_parts() if hasattr(layer, "block_parts") else None
                if parts is not None and _can_fuse(parts) and (not run or _same_shape(run[0][1], parts)):
                    run.append((layer, parts))
                    continue
                if run:
                    units.append(FusedDecoderLayers([m for m, _ in run], [p for _, p in run]))
                    num_fused += len(run)
                    run = []
                if parts is not None and _can_fuse(parts):
                    run.append((layer, parts))
                elif layer is not None:
                    units.append(layer)
            setattr(module, name, nn.ModuleList(units))
    return num_fused
