"""RMSNorm, computed in float32 as Hugging Face Llama does; a per-row reduction, hence batch-invariant.

With a `residual`, the layer first adds it (`x + residual`, rounded to x's dtype, as the unfused
`hidden + out` of a pre-norm block) and returns both the normalized sum and the sum, so the add fuses into
the norm. With kernel ops (backend.py) this is one kernel call (`fused_add_rms_norm`) where x has the weight's
dtype.
"""

from __future__ import annotations

import torch
from torch import nn

from rill.shard.layers.backend import KernelLayer


class RMSNorm(KernelLayer):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """rmsnorm(x), or (rmsnorm(x + residual), x + residual) when a residual is given."""
        if self.ops is not None and x.dtype == self.weight.dtype:
            out, new_residual = self.ops.fused_add_rms_norm(x, residual, self.weight, self.eps)
            return out if residual is None else (out, new_residual)
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        input_dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(input_dtype)


def norm_heads(norm: RMSNorm, x: torch.Tensor) -> torch.Tensor:
    """`norm` over the last dim of [tokens, heads, head_dim] (a per-head q/k norm), as rows of a 2-D
    tensor."""
    return norm(x.reshape(-1, x.shape[-1])).view(x.shape)
