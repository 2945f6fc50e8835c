"""Rotary position embedding (rotate-half layout, as HF Llama) and the rope scalings of Hugging Face configs.

Each scaling is fixed at construction: `inv_freq` and an attention factor (yarn, longrope) that multiplies
cos and sin. Where transformers recomputes the frequencies per call from the sequence length (`dynamic`, and
`longrope`'s short/long switch), Rill uses the frequencies for the longest context the model serves, so a
token's rotation never depends on the batch or on how long the sequence will grow:
- dynamic: NTK base for `factor * max_position_embeddings` tokens (as vLLM does);
- longrope: the long factors when `max_position_embeddings > original_max_position_embeddings` (the 128k
  Phi-3 models), else the short ones; transformers uses the short ones while a sequence fits the original
  context.
"""

from __future__ import annotations

import math

import torch

from rill.shard.layers.backend import KernelLayer


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


def linear_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    """Position interpolation: every frequency / `factor`."""
    return inv_freq / float(scaling["factor"])


def dynamic_ntk_inv_freq(rope_theta: float, head_dim: int, scaling: dict) -> torch.Tensor:
    """NTK-aware base for a context of `factor` times `max_position_embeddings` (see the module docstring)."""
    factor = float(scaling["factor"])
    base = rope_theta * (2 * factor - 1) ** (head_dim / (head_dim - 2))
    return _default_inv_freq(base, head_dim)


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def yarn_inv_freq(rope_theta: float, head_dim: int, scaling: dict) -> tuple[torch.Tensor, float]:
    """YaRN: interpolated low frequencies, extrapolated high ones, a linear ramp between (by dimension), and
    an attention factor from `factor` (or `mscale` / `mscale_all_dim`, or `attention_factor` as given)."""
    factor = float(
        scaling.get("factor")
        or scaling["max_position_embeddings"] / scaling["original_max_position_embeddings"]
    )
    original_len = float(scaling["original_max_position_embeddings"])
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = yarn_mscale(factor)
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def dimension_of(num_rotations: float) -> float:
        return head_dim * math.log(original_len / (num_rotations * 2 * math.pi)) / (2 * math.log(rope_theta))

    low, high = dimension_of(beta_fast), dimension_of(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolated = _default_inv_freq(rope_theta, head_dim)
    interpolated = extrapolated / factor
    return interpolated * ramp + extrapolated * (1 - ramp), float(attention_factor)


def longrope_inv_freq(rope_theta: float, head_dim: int, scaling: dict) -> tuple[torch.Tensor, float]:
    """LongRoPE (Phi-3): per-dimension rescale factors (long or short, see the module docstring) and an
    attention factor sqrt(1 + log(factor) / log(original context))."""
    original_len = scaling["original_max_position_embeddings"]
    max_len = scaling["max_position_embeddings"]
    factor = scaling.get("factor") or max_len / original_len
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original_len))
    ext_factors = torch.tensor(
        scaling["long_factor"] if max_len > original_len else scaling["short_factor"], dtype=torch.float32
    )
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    return 1.0 / (ext_factors * rope_theta**exponents), float(attention_factor)


ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "longrope", "llama3")


def _default_inv_freq(rope_theta: float, head_dim: int) -> torch.Tensor:
    return 1.0 / (rope_theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))


def rope_parameters(
    head_dim: int, rope_theta: float, rope_scaling: dict | None
) -> tuple[torch.Tensor, float]:
    """(inv_freq [head_dim / 2] in float32, attention factor) for a config's rope scaling. `rope_scaling` is
    the config's scaling dict with `max_position_embeddings` (and `original_max_position_embeddings` where
    the config has it at top level) merged in; None or rope_type "default" is plain RoPE."""
    scaling = rope_scaling or {}
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "default":
        return _default_inv_freq(rope_theta, head_dim), 1.0
    if rope_type == "linear":
        return linear_inv_freq(_default_inv_freq(rope_theta, head_dim), scaling), 1.0
    if rope_type == "llama3":
        return llama3_inv_freq(_default_inv_freq(rope_theta, head_dim), scaling), 1.0
    if rope_type == "dynamic":
        return dynamic_ntk_inv_freq(rope_theta, head_dim, scaling), 1.0
    if rope_type == "yarn":
        return yarn_inv_freq(rope_theta, head_dim, scaling)
    if rope_type == "longrope":
        return longrope_inv_freq(rope_theta, head_dim, scaling)
    raise ValueError(
        f"unsupported rope_type {rope_type!r} in the model config (supported: {', '.join(ROPE_TYPES)})"
    )


TABLE_CHUNK = 1024  # positions per piece of a cos/sin table


class CosSinTable:
    """cos and sin of `position * inv_freq`, times the attention factor, float32 [positions, head_dim / 2],
    for positions 0, 1, ... as far as any call has asked. It grows in pieces of TABLE_CHUNK positions, each
    computed once by one call of the same shape, and is never recomputed: a position's values are the same
    bits whatever batch asks for them, and a forward looks them up instead of computing cos/sin per layer."""

    def __init__(self, inv_freq: torch.Tensor, attention_factor: float) -> None:
        self.inv_freq, self.attention_factor = inv_freq, attention_factor
        self.cos = torch.empty(0, inv_freq.numel(), device=inv_freq.device)
        self.sin = torch.empty_like(self.cos)
        # The last lookup (positions copied, dtype, result): every layer of a forward asks the same.
        self._last: tuple[torch.Tensor, torch.dtype, tuple[torch.Tensor, torch.Tensor]] | None = None
        self.is_reserved = False

    def lookup(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [len(positions), head_dim / 2] in `dtype`."""
        if (
            self.is_reserved
        ):  # no host sync: a plain gather (the caller keeps positions below the reservation)
            return self.cos[positions].to(dtype), self.sin[positions].to(dtype)
        last = self._last
        if last is not None and last[1] == dtype and torch.equal(last[0], positions):
            return last[2]
        self._grow(int(positions.max()) + 1 if positions.numel() else 0)
        cos_sin = self.cos[positions].to(dtype), self.sin[positions].to(dtype)
        self._last = (positions.clone(), dtype, cos_sin)
        return cos_sin

    def reserve(self, num_positions: int) -> None:
        """Grows the table to `num_positions` now and never again, so lookups need no host sync (CUDA graphs
        capture them; a graph keeps reading the tensor it captured)."""
        self._grow(num_positions)
        self.is_reserved = True

    def _grow(self, num_needed: int) -> None:
        while self.cos.shape[0] < num_needed:
            start = self.cos.shape[0]
            piece = torch.arange(start, start + TABLE_CHUNK, device=self.inv_freq.device).float()
            freqs = piece[:, None] * self.inv_freq[None, :]
            self.cos = torch.cat([self.cos, freqs.cos() * self.attention_factor])
            self.sin = torch.cat([self.sin, freqs.sin() * self.attention_factor])


# One table per distinct (frequencies, attention factor, device), shared by every layer that uses them.
_TABLES: dict[tuple[bytes, float, str], CosSinTable] = {}


class RotaryEmbedding(KernelLayer):
    """Rotates q and k by their token positions, with cos/sin from a shared `CosSinTable`."""

    def __init__(self, head_dim: int, rope_theta: float, rope_scaling: dict | None) -> None:
        super().__init__()
        inv_freq, self.attention_factor = rope_parameters(head_dim, rope_theta, rope_scaling)
        # A plain attribute, not a buffer: `model.to(bfloat16)` must not round the frequencies (HF keeps them
        # in float32 too). The model is built under the target device, so no move is needed.
        self.inv_freq = inv_freq.to(torch.get_default_device())
        self._table: CosSinTable | None = None

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [tokens, head_dim / 2] in `dtype`, attention factor included."""
        return self.table().lookup(positions, dtype)

    def table(self) -> CosSinTable:
        """The table shared with every layer of the same frequencies (made on first use)."""
        if self._table is None:
            key = (self.inv_freq.cpu().numpy().tobytes(), self.attention_factor, str(self.inv_freq.device))
            self._table = _TABLES.setdefault(key, CosSinTable(self.inv_freq, self.attention_factor))
        return self._table

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q: [tokens, heads, head_dim], k: [tokens, kv_heads, head_dim], positions: [tokens]. With kernel
        ops, q and k are rotated in place and returned."""
        cos, sin = self.cos_sin(positions, q.dtype)
        if self.ops is not None:
            self.ops.rotary_embedding(q, k, cos, sin)
            return q, k
        cos = torch.cat([cos, cos], dim=-1)[:, None, :]
        sin = torch.cat([sin, sin], dim=-1)[:, None, :]
        return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin
