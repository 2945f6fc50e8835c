"""Rotary position embedding (rotate-half layout, as HF Llama), with "default" and "llama3" scaling."""

from __future__ import annotations

import math

import torch
from torch import nn

from rill import kernels
from rill.shard.layers.attention import kernels_active


def llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    """Llama 3.1 frequency scaling: long wavelengths / `factor`, short ones kept, smooth in between."""
    factor = float(scaling["factor"])
    low_freq_factor = float(scaling.get("low_freq_factor", 1.0))
    high_freq_factor = float(scaling.get("high_freq_factor", 4.0))
    old_context_len = float(scaling["original_max_position_embeddings"])
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """Rotates q and k by their token positions. cos/sin are computed per call: elementwise, so invariant."""

    def __init__(self, head_dim: int, rope_theta: float, rope_scaling: dict | None) -> None:
        super().__init__()
        inv_freq = 1.0 / (rope_theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        rope_type = (rope_scaling or {}).get("rope_type", (rope_scaling or {}).get("type", "default"))
        if rope_type == "llama3":
            inv_freq = llama3_inv_freq(inv_freq, rope_scaling)
        elif rope_type != "default":
            raise ValueError(f"unsupported rope_type {rope_type!r} (supported: default, llama3)")
        # A plain attribute, not a buffer: `model.to(bfloat16)` must not round the frequencies (HF keeps them
        # in float32 too). The model is built under the target device, so no move is needed.
        self.inv_freq = inv_freq

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q: [tokens, heads, head_dim], k: [tokens, kv_heads, head_dim], positions: [tokens]. With the CUDA
        kernels active, q and k are rotated in place and returned."""
        if kernels_active() and q.is_cuda:
            kernels.rotary_embedding(q, k, positions, self.inv_freq)
            return q, k
        freqs = positions[:, None].float() * self.inv_freq[None, :]
        emb = torch.cat([freqs, freqs], dim=-1)
        cos = emb.cos().to(q.dtype)[:, None, :]
        sin = emb.sin().to(q.dtype)[:, None, :]
        return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin
