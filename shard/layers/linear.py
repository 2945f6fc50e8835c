"""Linear layers whose per-row results do not depend on how many rows are in the batch.

Invariant: every matmul of activations by a weight goes through `invariant_matmul`, which pads the row count
up to a multiple of ROW_MULTIPLE (at least ROW_MULTIPLE). CPU GEMM picks different kernels for very small row
counts (measured: 1..5 rows differ bitwise from the same rows inside a larger product), so without padding a
decode step would not reproduce the logits of the same token computed inside a prefill.

Each parameter carries a `weight_loader(param, tensor, shard_id)` that `shard.weights` calls; fused layers
(qkv, gate/up) map the Hugging Face tensors into their slices.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

ROW_MULTIPLE = 16


def invariant_matmul(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`x @ weight.T` for x of shape [rows, in]; row r of the result depends only on row r of x."""
    num_rows = x.shape[0]
    padded_rows = max(ROW_MULTIPLE, -(-num_rows // ROW_MULTIPLE) * ROW_MULTIPLE)
    if padded_rows != num_rows:
        x = torch.cat([x, x.new_zeros(padded_rows - num_rows, x.shape[1])])
    return (x @ weight.T)[:num_rows]


def _default_loader(param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
    assert shard_id is None, f"unexpected shard id {shard_id!r} for an unfused parameter"
    if param.shape != loaded.shape:
        raise ValueError(f"weight shape {tuple(loaded.shape)} does not match parameter {tuple(param.shape)}")
    param.data.copy_(loaded)


class Linear(nn.Module):
    """y = x W^T (+ b), batch-invariant. Bias is added after the matmul (addmm takes another path)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        self.bias: nn.Parameter | None = None
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False)
            self.bias.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        _default_loader(param, loaded, shard_id)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = invariant_matmul(x, self.weight)
        return y if self.bias is None else y + self.bias


class FusedLinear(Linear):
    """Several linear maps of the same input stacked along the output dim (qkv, or gate/up).

    `output_sizes` maps each shard id (as the checkpoint names the part) to its number of output rows, in
    the order the parts are stacked.
    """

    def __init__(self, in_features: int, output_sizes: dict[object, int], bias: bool = False) -> None:
        super().__init__(in_features, sum(output_sizes.values()), bias)
        self.output_offsets: dict[object, tuple[int, int]] = {}
        offset = 0
        for shard_id, size in output_sizes.items():
            self.output_offsets[shard_id] = (offset, size)
            offset += size

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        if shard_id not in self.output_offsets:
            raise ValueError(f"unknown part {shard_id!r}; this fused layer has {list(self.output_offsets)}")
        offset, size = self.output_offsets[shard_id]
        _default_loader(param.data.narrow(0, offset, size), loaded)

    def split(self, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(y.split([size for _, size in self.output_offsets.values()], dim=-1))


WeightLoader = Callable[[nn.Parameter, torch.Tensor, object], None]
