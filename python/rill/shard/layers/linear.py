"""Linear layers, tensor-parallel, whose per-row results do not depend on how many rows are in the batch.

Invariant: every matmul of activations by a weight goes through `invariant_matmul`, whose row r depends only
on row r of its input. With kernel ops that provide `linear` (the CPU's: float32, and bfloat16 where the CPU
has AVX512-BF16) that is `KernelOps.linear`, whose arithmetic per output is fixed whatever the row count or
thread count; it reads the weight packed once when the ops are installed (`PackedWeight`), and the layer then
keeps only the packed copy. The torch reference pads the row count up to a multiple of ROW_MULTIPLE (at least
ROW_MULTIPLE): CPU GEMM (MKL/oneDNN) picks different kernels for small row counts (measured: with 1 thread,
1..15 rows differ bitwise from the same rows inside a 600-row product); with 2 threads it also splits some
shapes differently at larger row counts (a [1536 -> 576] product differed at 64 and 100 rows), which padding
cannot fix and the CPU kernel does. In bfloat16 on a CPU without AVX512-BF16, where Rill promises no batch
invariance, the CPU kernels' `linear` calls torch's matmul as it is (oneDNN).

Tensor parallelism (Megatron-style, as in vLLM and nano-vllm): a column-parallel layer holds this rank's
slice of the output features and returns its slice of the output (no communication); a row-parallel layer
holds the slice of input features matching the previous column-parallel output, and sums the partial
results of every rank (`rill.shard.distributed.all_reduce`, rank order). So qkv -> attention -> o_proj and
gate/up -> silu -> down each cost one all-reduce. With one rank every layer is the plain linear map.

Each parameter carries a `weight_loader(param, loaded, shard_id)` that `rill.shard.weights` calls with a
checkpoint tensor or a lazily read safetensors slice; the loader reads only this rank's rows or columns.
Fused layers (qkv, gate/up) map the Hugging Face tensors (`shard_id` names the part) into their slices.

Quantized weights (a GGUF file served as it is, or `--quantize`) reach a layer through `load_quantized`
instead: each part stays a `rill.kernels.quant.QuantizedTensor`, and the ops that provide `pack_quantized`
multiply them as they are (the CPU kernels, with float32 or int8 activations: docs/kernels.md). On the torch
references the layer de-quantizes its weight once and multiplies floats. One rank only: a quantized weight is
not split.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch import nn

from rill.kernels.ops import KernelOps
from rill.kernels.quant import QuantizedTensor, dequantize
from rill.shard import distributed
from rill.shard.layers.backend import KernelLayer

ROW_MULTIPLE = 16


class AdapterProduct(Protocol):
    """What a projection asks of its LoRA adapter slots (`rill.shard.layers.lora.LoraStack`)."""

    def use_ops(self, ops: KernelOps | None) -> None: ...

    def add(self, y: torch.Tensor, x: torch.Tensor) -> None:
        """y += the adapter product of each row of x that runs with an adapter, in place."""


class PackedWeight:
    """A layer's weight [out, in] as kernel ops multiply it: packed once by `ops.pack_linear`, or, quantized
    (its parts in row order), by `ops.pack_quantized`."""

    def __init__(self, weight: torch.Tensor | list[QuantizedTensor], ops: KernelOps) -> None:
        self.ops = ops
        if isinstance(weight, list):
            self.out_features, self.in_features = sum(p.shape[0] for p in weight), weight[0].shape[1]
            self.tensor = ops.pack_quantized(weight)
        else:
            self.out_features, self.in_features = weight.shape
            self.tensor = ops.pack_linear(weight)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """`x @ weight.T`, row r depending only on row r of x (where the ops promise it)."""
        return self.ops.linear(x, self.tensor, self.out_features)


def pack_for(layer: Any, keep_weight: bool) -> PackedWeight | None:
    """The packed weight of a layer (a `Linear`, the LM head) whose ops provide `linear`, packed once (None
    while it has neither ops nor a packed weight); unless `keep_weight` (a tied weight others read), the
    packed copy replaces the layer's `weight`. A quantized layer (`quantized` set) is packed from its parts
    where the ops provide `pack_quantized`; otherwise its weight is de-quantized once, for the references.
    Either way the parts are dropped (views of a GGUF file's mapping keep all of it resident)."""
    if layer.quantized is not None:
        if layer.ops is not None and layer.ops.provides("pack_quantized"):
            packed = PackedWeight(layer.quantized, layer.ops)
            layer.weight, layer.quantized = None, None
            return packed
        layer.weight = nn.Parameter(torch.cat([dequantize(p) for p in layer.quantized]), requires_grad=False)
        layer.quantized = None
    if layer.ops is None or layer.packed is not None:
        return layer.packed
    packed = PackedWeight(layer.weight, layer.ops)
    if packed.tensor is not layer.weight and not keep_weight:
        layer.weight = None
    return packed


def invariant_matmul(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`x @ weight.T` for x of shape [rows, in] with torch's matmul; in float32 row r of the result depends
    only on row r of x (rows padded to a multiple of ROW_MULTIPLE)."""
    num_rows = x.shape[0]
    padded_rows = max(ROW_MULTIPLE, -(-num_rows // ROW_MULTIPLE) * ROW_MULTIPLE)
    if padded_rows != num_rows:
        x = torch.cat([x, x.new_zeros(padded_rows - num_rows, x.shape[1])])
    return (x @ weight.T)[:num_rows]


def loaded_shape(loaded: Any) -> tuple[int, ...]:
    """Shape of a checkpoint tensor or of a safetensors slice (`safe_open(...).get_slice(name)`)."""
    return tuple(loaded.shape) if isinstance(loaded, torch.Tensor) else tuple(loaded.get_shape())


def read_part(loaded: Any, dim: int | None = None, start: int = 0, size: int | None = None) -> torch.Tensor:
    """Rows (dim 0) or columns (dim 1) [start, start + size) of `loaded`, or all of it when dim is None.
    A safetensors slice reads only those bytes from the memory-mapped file."""
    if dim is None:
        return loaded if isinstance(loaded, torch.Tensor) else loaded[:]
    index = [slice(None)] * len(loaded_shape(loaded))
    index[dim] = slice(start, start + (loaded_shape(loaded)[dim] - start if size is None else size))
    return loaded[tuple(index)]


def copy_into(param: torch.Tensor, loaded: torch.Tensor) -> None:
    if param.shape != loaded.shape:
        raise ValueError(f"weight shape {tuple(loaded.shape)} does not match parameter {tuple(param.shape)}")
    param.copy_(loaded)


def divide(numerator: int, denominator: int, what: str) -> int:
    if numerator % denominator != 0:
        raise ValueError(
            f"{what} ({numerator}) is not divisible by the tensor-parallel size ({denominator}); "
            f"choose a --num-shard that divides it"
        )
    return numerator // denominator


class Linear(KernelLayer):
    """y = x W^T (+ b), replicated on every rank, batch-invariant. Bias is added after the matmul (addmm
    takes another path)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.tp_rank, self.tp_size = distributed.get_rank(), distributed.get_world_size()
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        self.bias: nn.Parameter | None = None
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        self.packed: PackedWeight | None = None  # set with kernel ops, after loading
        # Quantized parts in row order (`load_quantized`), until packed; None for a float weight.
        self.quantized: list[QuantizedTensor] | None = None
        self._quantized_parts: dict[object, QuantizedTensor] = {}
        # Adapter slots (rill.shard.layers.lora), set before the ops are installed when the shard serves LoRA.
        self.lora: AdapterProduct | None = None

    def weight_loader(self, param: nn.Parameter, loaded: Any, shard_id: object = None) -> None:
        assert shard_id is None, f"unexpected shard id {shard_id!r} for an unfused parameter"
        copy_into(param.data, read_part(loaded))

    def load_quantized(self, tensor: QuantizedTensor, shard_id: object = None) -> None:
        """Takes a quantized checkpoint tensor (a part of a fused layer under `shard_id`) as it is; once every
        part is there, they replace the float weight, in the order of the layer's rows."""
        if self.tp_size != 1:
            raise ValueError("quantized weights run on one shard only (--num-shard 1)")
        parts = getattr(self, "parts", {None: (0, self.weight.shape[0], 0)})
        if shard_id not in parts:
            raise ValueError(f"unknown part {shard_id!r}; this layer has {list(parts)}")
        _, size, _ = parts[shard_id]
        if tensor.shape != (size, self.weight.shape[1]):
            raise ValueError(
                f"quantized weight {tensor.shape} does not match "
                f"{(size, self.weight.shape[1])} ({shard_id!r})"
            )
        self._quantized_parts[shard_id] = tensor
        if len(self._quantized_parts) == len(parts):
            self.quantized = [self._quantized_parts.pop(part) for part in parts]

    @property
    def partly_quantized(self) -> bool:
        """Some parts came quantized and others not (a file that stores a fused layer's parts in float and
        quantized types): the layer cannot run either way."""
        return bool(self._quantized_parts)

    def accepts(self, ops: KernelOps) -> bool:
        return ops.provides("linear")

    def use_ops(self, ops: KernelOps | None) -> None:
        super().use_ops(ops)
        self.packed = pack_for(self, keep_weight=False)
        if self.lora is not None:
            self.lora.use_ops(ops)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is None:
            return invariant_matmul(x, self.weight)
        return self.packed.matmul(x)

    def project(self, x: torch.Tensor) -> torch.Tensor:
        """x W^T plus the adapter product of each row that has one (before any bias)."""
        y = self.matmul(x)
        if self.lora is not None:
            self.lora.add(y, x)
        return y

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.project(x)
        return y if self.bias is None else y + self.bias


class ColumnParallelLinear(Linear):
    """Output features split across ranks: this rank holds rows [rank * out/N, (rank + 1) * out/N) of W
    (and of the bias) and returns that slice of y."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        tp_size = distributed.get_world_size()
        super().__init__(in_features, divide(out_features, tp_size, "output features"), bias)

    def weight_loader(self, param: nn.Parameter, loaded: Any, shard_id: object = None) -> None:
        assert shard_id is None, f"unexpected shard id {shard_id!r} for an unfused parameter"
        size = param.shape[0]
        copy_into(param.data, read_part(loaded, 0, self.tp_rank * size, size))


class MergedColumnParallelLinear(Linear):
    """Several column-parallel maps of the same input stacked along the output dim (gate/up). Each part is
    split across ranks on its own, so this rank's output is [part0 slice, part1 slice, ...].

    `output_sizes` maps each shard id (as the checkpoint names the part) to its full number of output rows,
    in the order the parts are stacked.
    """

    def __init__(self, in_features: int, output_sizes: dict[object, int], bias: bool = False) -> None:
        tp_size = distributed.get_world_size()
        local_sizes = {
            part: divide(size, tp_size, f"output size of {part!r}") for part, size in output_sizes.items()
        }
        super().__init__(in_features, sum(local_sizes.values()), bias)
        # shard id -> (offset in this rank's parameter, rows, first row in the checkpoint tensor)
        self.parts: dict[object, tuple[int, int, int]] = {}
        offset = 0
        for part, size in local_sizes.items():
            self.parts[part] = (offset, size, self.tp_rank * size)
            offset += size

    def weight_loader(self, param: nn.Parameter, loaded: Any, shard_id: object = None) -> None:
        if shard_id not in self.parts:
            raise ValueError(f"unknown part {shard_id!r}; this fused layer has {list(self.parts)}")
        offset, size, start = self.parts[shard_id]
        copy_into(param.data.narrow(0, offset, size), read_part(loaded, 0, start, size))

    def split(self, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(y.split([size for _, size, _ in self.parts.values()], dim=-1))


class QKVParallelLinear(MergedColumnParallelLinear):
    """Fused q/k/v projection split by attention heads: this rank holds `num_heads` query heads (the
    model's heads / N) and `num_kv_heads` KV heads. With at least N KV heads they are split too (N must
    divide them); with fewer, each KV head is replicated on N / num_kv_heads consecutive ranks, the ones
    whose query heads use it (N must be a multiple of the KV heads)."""

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        total_num_heads: int,
        total_num_kv_heads: int,
        bias: bool = False,
    ) -> None:
        tp_rank, tp_size = distributed.get_rank(), distributed.get_world_size()
        num_heads = divide(total_num_heads, tp_size, "num_attention_heads")
        if total_num_kv_heads >= tp_size:
            num_kv_heads = divide(total_num_kv_heads, tp_size, "num_key_value_heads")
            first_kv_head = tp_rank * num_kv_heads
        else:
            if tp_size % total_num_kv_heads != 0:
                raise ValueError(
                    f"num_key_value_heads ({total_num_kv_heads}) is fewer than the tensor-parallel size "
                    f"({tp_size}) and does not divide it, so KV heads cannot be replicated evenly; "
                    f"choose a --num-shard that divides or is a multiple of it"
                )
            num_kv_heads = 1
            first_kv_head = tp_rank // (tp_size // total_num_kv_heads)
        q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
        # The sizes are per rank already, so skip MergedColumnParallelLinear's division by N.
        Linear.__init__(self, hidden_size, q_size + 2 * kv_size, bias)
        self.num_heads, self.num_kv_heads = num_heads, num_kv_heads
        self.parts = {
            "q": (0, q_size, tp_rank * q_size),
            "k": (q_size, kv_size, first_kv_head * head_dim),
            "v": (q_size + kv_size, kv_size, first_kv_head * head_dim),
        }


class RowParallelLinear(Linear):
    """Input features split across ranks (this rank holds columns [rank * in/N, (rank + 1) * in/N) of W,
    matching a column-parallel layer's output slice); the partial products are summed over ranks, then the
    bias (replicated) is added once."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        tp_size = distributed.get_world_size()
        super().__init__(divide(in_features, tp_size, "input features"), out_features, bias)

    def weight_loader(self, param: nn.Parameter, loaded: Any, shard_id: object = None) -> None:
        assert shard_id is None, f"unexpected shard id {shard_id!r} for an unfused parameter"
        if param is self.bias:
            copy_into(param.data, read_part(loaded))
            return
        size = param.shape[1]
        copy_into(param.data, read_part(loaded, 1, self.tp_rank * size, size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = distributed.all_reduce(self.project(x))
        return y if self.bias is None else y + self.bias


WeightLoader = Callable[[nn.Parameter, Any, object], None]
