"""Paged attention (torch reference, runs on the CPU) and the forward context that carries its metadata.

The context: `forward_context(ctx)` is the one place attention metadata is set, for the duration of one
forward pass; nesting is refused. Layers read it with `get_forward_context()`; models never pass it around.

Batch invariance: the output for a query at position p must not depend on which other queries are computed in
the same call (other sequences, or more tokens of the same sequence). So for each query we walk its keys in
fixed-size tiles of KEY_TILE_SIZE keys, always starting at position 0, and combine tiles with an online
softmax (running max m, running sum l, rescaled accumulator). Keys past a query's position score -inf; a
fully masked tile then leaves m, l and the accumulator bitwise unchanged (exp(-inf) = 0, rescale exp(0) = 1),
so a query gets the same result in a 1000-token prefill, a 50-token chunk or a decode step. Every matmul
has a fixed key count (a tile is zero-padded past the context) and a row count padded to a multiple of
ROW_MULTIPLE. Plain softmax over the whole row and F.scaled_dot_product_attention are not (measured).

Kernels (backend.py): with ops, the layer stores its K/V and attends in two calls of them
(`KernelOps.store_kv`, `KernelOps.paged_attention`, with the scale pools of an int8 KV pool) for the whole
batch; the CPU kernels are batch-invariant in the same sense (docs/kernels.md), the CUDA ones are not across
batch shapes (their decode split count depends on the batch), as the GPU's bf16 GEMMs are not either. The
reference reads an int8 pool dequantized (`KVCache.rows`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from rill.kernels.ops import AttentionMetadata, KernelOps
from rill.shard.kv_cache import KVCache
from rill.shard.layers.backend import KernelLayer
from rill.shard.layers.linear import ROW_MULTIPLE

KEY_TILE_SIZE = 256


@dataclass(frozen=True)
class ForwardContext:
    """What the layers of one forward pass read: the KV pool and the batch's `AttentionMetadata` (attention),
    and each token row's LoRA slot (the projections with adapters, `rill.shard.layers.lora`)."""

    kv_cache: KVCache
    meta: AttentionMetadata
    # int32 [num_tokens]: the LoRA slot of each row's adapter, -1 for the base model; None when no row of the
    # batch uses an adapter.
    lora_slots: torch.Tensor | None = None


_current_context: ForwardContext | None = None


@contextmanager
def forward_context(ctx: ForwardContext) -> Iterator[ForwardContext]:
    global _current_context
    if _current_context is not None:
        raise RuntimeError("a forward context is already active; forward passes do not nest")
    _current_context = ctx
    try:
        yield ctx
    finally:
        _current_context = None


def get_forward_context() -> ForwardContext:
    if _current_context is None:
        raise RuntimeError("attention called outside `forward_context`; the runner must set it")
    return _current_context


def _pad_rows(x: torch.Tensor) -> torch.Tensor:
    """Pads dim -2 of x up to a multiple of ROW_MULTIPLE (at least ROW_MULTIPLE) with zeros."""
    num_rows = x.shape[-2]
    padded_rows = max(ROW_MULTIPLE, -(-num_rows // ROW_MULTIPLE) * ROW_MULTIPLE)
    if padded_rows == num_rows:
        return x
    padding = x.new_zeros(*x.shape[:-2], padded_rows - num_rows, x.shape[-1])
    return torch.cat([x, padding], dim=-2)


def tiled_causal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    query_positions: torch.Tensor,
    scale: float,
    key_tile_size: int = KEY_TILE_SIZE,
    sliding_window: int = 0,
    softcap: float = 0.0,
) -> torch.Tensor:
    """Causal GQA for one sequence, invariant to how its queries are chunked.

    q: [num_queries, num_heads, head_dim] at `query_positions`; k, v: [context_len, num_kv_heads, head_dim],
    the sequence's keys from position 0. Returns [num_queries, num_heads, head_dim] in q's dtype.
    `sliding_window` > 0: a query at p sees only keys at positions > p - sliding_window. `softcap` > 0:
    scores become softcap * tanh(score / softcap) before the softmax (Gemma 2). Tiles that every query's
    window has left are skipped: they would leave the running state bitwise unchanged. Keys before the
    first query's window are never read, so they may be garbage (a released block's null entry).
    """
    num_queries, num_heads, head_dim = q.shape
    context_len, num_kv_heads, _ = k.shape
    group = num_heads // num_kv_heads
    # Rows are (query, head-in-group) pairs for each kv head: [kv_heads, queries * group, head_dim].
    q_rows = (q.float() * scale).view(num_queries, num_kv_heads, group, head_dim)
    q_rows = q_rows.permute(1, 0, 2, 3).reshape(num_kv_heads, num_queries * group, head_dim)
    q_rows = _pad_rows(q_rows)
    num_rows = num_queries * group
    row_positions = query_positions.repeat_interleave(group)
    row_max = torch.full((num_kv_heads, num_rows, 1), float("-inf"), device=q.device)
    row_sum = torch.zeros((num_kv_heads, num_rows, 1), device=q.device)
    acc = torch.zeros((num_kv_heads, num_rows, head_dim), device=q.device)
    first_visible = 0
    if sliding_window > 0:
        first_visible = max(0, int(query_positions.min()) - sliding_window + 1)
    for tile_start in range(first_visible // key_tile_size * key_tile_size, context_len, key_tile_size):
        tile_end = min(tile_start + key_tile_size, context_len)
        # Keys before the first query's window are never read (they may lie in the null block, garbage
        # once the router released their block): they stay zeros, masked; zeros make the same sums.
        copy_start = max(tile_start, first_visible)
        k_tile = k.new_zeros(key_tile_size, num_kv_heads, head_dim, dtype=torch.float32)
        v_tile = torch.zeros_like(k_tile)
        k_tile[copy_start - tile_start : tile_end - tile_start] = k[copy_start:tile_end]
        v_tile[copy_start - tile_start : tile_end - tile_start] = v[copy_start:tile_end]
        scores = (q_rows @ k_tile.permute(1, 2, 0))[:, :num_rows]  # [kv_heads, rows, tile]
        if softcap > 0.0:
            scores = torch.tanh(scores / softcap) * softcap
        key_positions = torch.arange(tile_start, tile_start + key_tile_size, device=q.device)
        is_masked = key_positions[None, :] > row_positions[:, None]
        if sliding_window > 0:
            is_masked |= key_positions[None, :] <= row_positions[:, None] - sliding_window
        scores = scores.masked_fill(is_masked, float("-inf"))
        new_max = torch.maximum(row_max, scores.amax(dim=-1, keepdim=True))
        # A row with no visible key yet (its window starts in a later tile) keeps max -inf: subtract 0.
        safe_max = new_max.masked_fill(new_max == float("-inf"), 0.0)
        rescale = torch.exp(row_max - safe_max)
        probs = torch.exp(scores - safe_max)
        row_sum = row_sum * rescale + probs.sum(dim=-1, keepdim=True)
        acc = acc * rescale + (_pad_rows(probs) @ v_tile.permute(1, 0, 2))[:, :num_rows]
        row_max = new_max
    out = (acc / row_sum).view(num_kv_heads, num_queries, group, head_dim).permute(1, 0, 2, 3)
    return out.reshape(num_queries, num_heads, head_dim).to(q.dtype)


class PagedAttention(KernelLayer):
    """Stores this layer's new K/V, then attends each sequence's queries through its block table."""

    def __init__(
        self,
        layer_id: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float,
        sliding_window: int = 0,
        softcap: float = 0.0,
    ) -> None:
        """`sliding_window` > 0: queries see only their last `sliding_window` positions; `softcap` > 0:
        attention logits are soft-capped (see `tiled_causal_attention`)."""
        super().__init__()
        if num_heads % num_kv_heads != 0:
            raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
        self.layer_id = layer_id
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.sliding_window = sliding_window
        self.softcap = softcap

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q: [tokens, heads, head_dim]; k, v: [tokens, kv_heads, head_dim] -> [tokens, heads, head_dim]."""
        ctx = get_forward_context()
        cache, meta = ctx.kv_cache, ctx.meta
        k_pool, v_pool = cache.k[self.layer_id], cache.v[self.layer_id]
        if self.ops is not None:
            k_scale, v_scale = cache.scales(self.layer_id)
            self.ops.store_kv(k, v, k_pool, v_pool, meta.slot_mapping, k_scale, v_scale)
            return self.ops.paged_attention(
                q, k_pool, v_pool, meta, self.scale, self.sliding_window, self.softcap, k_scale, v_scale
            )
        cache.store_kv(self.layer_id, k, v, meta.slot_mapping)
        out = torch.empty_like(q)
        cu_seqlens_q = meta.cu_seqlens_q.tolist()
        for i, context_len in enumerate(meta.context_lens.tolist()):
            start, end = cu_seqlens_q[i], cu_seqlens_q[i + 1]
            num_seq_blocks = -(-context_len // cache.block_size)
            blocks = meta.block_tables[i, :num_seq_blocks]
            seq_k, seq_v = cache.rows(self.layer_id, blocks, context_len)
            out[start:end] = tiled_causal_attention(
                q[start:end],
                seq_k,
                seq_v,
                meta.positions[start:end],
                self.scale,
                KEY_TILE_SIZE,
                self.sliding_window,
                self.softcap,
            )
        return out

    def unsupported(self, ops: KernelOps) -> str | None:
        return ops.attention_unsupported(
            self.head_dim, self.num_heads, self.num_kv_heads, self.sliding_window, self.softcap
        )
