"""SiLU-and-multiply, the gated activation of Llama-family MLPs: silu(gate) * up, elementwise per row."""

from __future__ import annotations

import torch
from torch import nn

from rill.kernels.ops import KernelOps
from rill.shard.layers.backend import KernelLayer


class SiluAndMul(KernelLayer):
    """x: [tokens, 2 * I] holding [gate | up] (a merged gate/up projection's output) -> [tokens, I]."""

    def accepts(self, ops: KernelOps) -> bool:
        return ops.provides("silu_and_mul")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.ops is not None:
            return self.ops.silu_and_mul(x)
        gate, up = x.chunk(2, dim=-1)
        return nn.functional.silu(gate) * up
