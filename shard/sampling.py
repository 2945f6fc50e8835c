"""Batched token choice: greedy argmax, or temperature / top-k / top-p, then Gumbel-max with hashed noise.

Reproducibility: the uniform noise for vocab entry j of the token at position p of a sequence with seed s is
u = hash(s, p, j), computed with integer tensor ops. It depends on nothing else in the batch, so a seed gives
the same output alone or batched, and the router can re-derive it after preempting and recomputing a sequence.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_MASK32 = 0xFFFFFFFF


@dataclass(frozen=True)
class SamplingParams:
    """How a sequence's next token is chosen (see `SamplingParams` in the proto)."""

    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0

    def validate(self) -> None:
        if not self.do_sample:
            return
        if not self.temperature > 0:
            raise ValueError(f"temperature must be > 0 when sampling, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1] when sampling, got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0 <= self.seed < 2**64:
            raise ValueError(f"seed must be in [0, 2^64), got {self.seed}")


@dataclass(frozen=True)
class SamplingBatch:
    """Per-row sampling parameters as tensors, one row per sampled sequence."""

    do_sample: torch.Tensor  # bool [rows]
    temperature: torch.Tensor  # float32 [rows]; 1.0 on greedy rows
    top_k: torch.Tensor  # int64 [rows]; 0 = no limit
    top_p: torch.Tensor  # float32 [rows]
    seed_lo: torch.Tensor  # int64 [rows]: low 32 bits of the seed
    seed_hi: torch.Tensor  # int64 [rows]: high 32 bits of the seed
    positions: torch.Tensor  # int64 [rows]: position of the token being generated

    @classmethod
    def build(cls, params: list[SamplingParams], positions: list[int], device: torch.device) -> SamplingBatch:
        def tensor(values: list, dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype, device=device)

        return cls(
            do_sample=tensor([p.do_sample for p in params], torch.bool),
            temperature=tensor([p.temperature if p.do_sample else 1.0 for p in params], torch.float32),
            top_k=tensor([p.top_k for p in params], torch.int64),
            top_p=tensor([p.top_p if p.do_sample else 1.0 for p in params], torch.float32),
            seed_lo=tensor([p.seed & _MASK32 for p in params], torch.int64),
            seed_hi=tensor([p.seed >> 32 for p in params], torch.int64),
            positions=tensor(positions, torch.int64),
        )


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer finalizer on int64 tensors holding values in [0, 2^32). Multipliers are below 2^31, so
    products stay below 2^63 and nothing overflows."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _MASK32
    x = x ^ (x >> 15)
    x = (x * 0x1B873593) & _MASK32
    return x ^ (x >> 16)


def uniform_noise(
    seed_lo: torch.Tensor, seed_hi: torch.Tensor, positions: torch.Tensor, vocab_size: int
) -> torch.Tensor:
    """u in (0, 1) of shape [rows, vocab], a pure function of (seed, position, vocab index)."""
    h = _mix32(_mix32(seed_lo ^ 0x2545F491) ^ seed_hi)
    h = _mix32(h ^ (positions & _MASK32))[:, None]
    vocab_index = torch.arange(vocab_size, dtype=torch.int64, device=positions.device)[None, :]
    h = _mix32(_mix32(h ^ vocab_index) ^ 0x5BD1E995)
    return ((h >> 8).to(torch.float32) + 0.5) / float(1 << 24)


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Sets to -inf every logit outside its row's top-k and its row's top-p nucleus (ties broken by index)."""
    vocab_size = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=True, stable=True)
    rank = torch.arange(vocab_size, device=logits.device)[None, :]
    k = torch.where(top_k > 0, top_k.clamp(max=vocab_size), vocab_size)[:, None]
    is_removed = rank >= k
    sorted_logits = sorted_logits.masked_fill(is_removed, float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    # Keep a token if the probability mass strictly before it is below top_p; the first token always stays.
    mass_before = probs.cumsum(dim=-1) - probs
    is_removed = is_removed | ((mass_before >= top_p[:, None]) & (rank > 0))
    removed = torch.zeros_like(is_removed).scatter(-1, order, is_removed)
    return logits.masked_fill(removed, float("-inf"))


def sample(logits: torch.Tensor, batch: SamplingBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """logits: float32 [rows, vocab]. Returns (token ids int64 [rows], logprobs float32 [rows]); logprobs are
    under the raw (untempered, unfiltered) distribution."""
    tokens = logits.argmax(dim=-1)
    if bool(batch.do_sample.any()):
        scaled = logits / batch.temperature[:, None]
        filtered = apply_top_k_top_p(scaled, batch.top_k, batch.top_p)
        noise = uniform_noise(batch.seed_lo, batch.seed_hi, batch.positions, logits.shape[-1])
        gumbel = -torch.log(-torch.log(noise))
        sampled = (filtered + gumbel).argmax(dim=-1)
        tokens = torch.where(batch.do_sample, sampled, tokens)
    logprobs = logits.log_softmax(dim=-1).gather(-1, tokens[:, None]).squeeze(-1)
    return tokens, logprobs
