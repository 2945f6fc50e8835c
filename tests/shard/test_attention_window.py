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


@pytest.mark.parametrize("chunk", [(30, 40), (39, 40)])
def test_released_blocks_out_of_the_window_are_never_read(chunk: tuple[int, int]) -> None:
    """With every layer windowed, the router sends the blocks the window has left as the null block 0,
    whose contents are garbage: the torch path and the CPU kernel give bitwise what the real blocks give."""
    from rill.kernels import cpu
    from rill.kernels.ops import AttentionMetadata

    torch.manual_seed(1)
    block_size, window, head_dim, context_len = 4, 9, 16, 40
    num_blocks = context_len // block_size + 1
    k_pool = torch.randn(num_blocks, block_size, 2, head_dim)
    v_pool = torch.randn(num_blocks, block_size, 2, head_dim)
    k_pool[0] = float("nan")
    v_pool[0] = float("nan")
    start, end = chunk
    q = torch.randn(end - start, 4, head_dim)
    positions = torch.arange(start, end)
    scale = 1 / math.sqrt(head_dim)
    table = torch.arange(1, num_blocks)
    released = table.clone()
    num_dead = (start + 1 - window) // block_size
    released[:num_dead] = 0
    assert num_dead > 0

    def torch_path(blocks: torch.Tensor) -> torch.Tensor:
        k = k_pool[blocks].flatten(0, 1)[:end]
        v = v_pool[blocks].flatten(0, 1)[:end]
        return tiled_causal_attention(q, k, v, positions, scale, 16, window)

    expected = torch_path(table)
    assert not expected.isnan().any()
    assert torch.equal(torch_path(released), expected)
    ops = cpu.CpuOps()
    if ops.unavailable_reason() is None:

        def kernel(blocks: torch.Tensor) -> torch.Tensor:
            meta = AttentionMetadata.build([0, end - start], [end], blocks[None], torch.empty(0), positions)
            return ops.paged_attention(q, k_pool, v_pool, meta, scale, sliding_window=window)

        assert torch.equal(kernel(released), kernel(table))
