"""Sliding-window and soft-capped attention in the torch reference: equal to a plain masked softmax, and
bitwise the same however the queries are chunked (tiles the window has left are skipped)."""

from __future__ import annotations

import math

import pytest
import torch
from rill.shard.layers.attention import tiled_causal_attention


def naive_attention(q, k, v, scale: float, window: int, softcap: float) -> torch.Tensor:
    num_queries, num_heads, _ = q.shape
    group = num_heads // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q * scale, k)
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    positions = torch.arange(num_queries)
    distance = positions[:, None] - positions[None, :]
    is_masked = distance < 0
    if window:
        is_masked |= distance >= window
    probs = scores.masked_fill(is_masked, float("-inf")).softmax(-1)
    return torch.einsum("hqk,khd->qhd", probs, v)


@pytest.mark.parametrize(("window", "softcap"), [(5, 0.0), (0, 2.0), (9, 3.0), (1, 0.0)])
def test_window_and_softcap_match_reference_and_chunking(window: int, softcap: float) -> None:
    torch.manual_seed(0)
    num_tokens, head_dim = 37, 16
    q, k, v = (
        torch.randn(num_tokens, 4, head_dim),
        torch.randn(num_tokens, 2, head_dim),
        torch.randn(num_tokens, 2, head_dim),
    )
    scale = 1 / math.sqrt(head_dim)
    positions = torch.arange(num_tokens)
    full = tiled_causal_attention(q, k, v, positions, scale, 4, window, softcap)
    torch.testing.assert_close(full, naive_attention(q, k, v, scale, window, softcap), rtol=1e-5, atol=1e-5)
    for start, end in [(0, 3), (20, 21), (30, 37), (36, 37)]:
        part = tiled_causal_attention(
            q[start:end], k[:end], v[:end], positions[start:end], scale, 4, window, softcap
        )
        assert torch.equal(part, full[start:end])
