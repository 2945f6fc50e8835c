"""SiLU-and-multiply, the gated activation of Llama-family MLPs: silu(gate) * up, elementwise per row."""

from __future__ import annotations

import torch
from torch import nn

from rill.kernels import cpu as cpu_kernels
from rill.shard.layers.backend import Backend, KernelLayer


class SiluAndMul(KernelLayer):
    """x: [tokens, 2 * I] holding [gate | up] (a merged gate/up projection's output) -> [tokens, I]."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.backend is Backend.CPU:
            return cpu_kernels.silu_and_mul(x)
        gate, up = x.chunk(2, dim=-1)
        return nn.functional.silu(gate) * up
