"""Random paged-attention cases and the two ways to run them (torch reference / CUDA kernels), shared by the
GPU tests (tests/shard/test_kernels.py) and bench/gpu_check.py.

A case scatters each sequence's blocks over the pool in random order, pads block tables with the null block 0,
and poisons (NaN) block 0 and every slot past a sequence's context, so a kernel that reads a padded or unused
slot produces NaN instead of a plausible number. Kernel outputs are poisoned before the call too.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from rill import kernels
from rill.shard.kv_cache import KVCache
from rill.shard.layers.attention import ForwardContext, KernelMetadata, PagedAttention, forward_context
from rill.shard.layers.backend import Backend


@dataclass
class AttentionCase:
    q: torch.Tensor  # [num_tokens, num_heads, head_dim]
    k: torch.Tensor  # [num_tokens, num_kv_heads, head_dim], the new tokens' keys
    v: torch.Tensor
    k_pool: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_pool: torch.Tensor
    block_tables: torch.Tensor  # int64 [num_seqs, max_blocks]
    slot_mapping: torch.Tensor  # int64 [num_tokens]
    positions: torch.Tensor  # int64 [num_tokens]
    cu_seqlens_q: list[int]
    context_lens: list[int]
    scale: float

    @property
    def is_decode(self) -> bool:
        return self.cu_seqlens_q[-1] == len(self.context_lens)

    def metadata(self, max_context_len: int | None = None) -> KernelMetadata:
        device = self.q.device
        query_lens = [b - a for a, b in zip(self.cu_seqlens_q[:-1], self.cu_seqlens_q[1:], strict=True)]
        return KernelMetadata(
            context_lens=torch.tensor(self.context_lens, dtype=torch.int32, device=device),
            cu_seqlens_q=torch.tensor(self.cu_seqlens_q, dtype=torch.int32, device=device),
            max_query_len=max(query_lens),
            max_context_len=max_context_len or max(self.context_lens),
            is_decode=self.is_decode,
        )


def make_case(
    query_lens: list[int],
    context_lens: list[int],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    device: str | torch.device = "cuda",
    seed: int = 0,
) -> AttentionCase:
    generator = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-n // block_size) for n in context_lens]
    num_blocks = 1 + sum(blocks_per_seq)
    order = (torch.randperm(num_blocks - 1, generator=generator) + 1).tolist()
    tables, next_index = [], 0
    for n in blocks_per_seq:
        tables.append(order[next_index : next_index + n])
        next_index += n
    max_blocks = max(blocks_per_seq)
    block_tables = torch.tensor([t + [0] * (max_blocks - len(t)) for t in tables], dtype=torch.int64)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_pool = torch.randn(shape, generator=generator).to(dtype)
    v_pool = torch.randn(shape, generator=generator).to(dtype)
    k_pool[0] = float("nan")
    v_pool[0] = float("nan")
    positions, slots, cu_seqlens_q = [], [], [0]
    for table, query_len, context_len in zip(tables, query_lens, context_lens, strict=True):
        last = context_len - 1
        k_pool[table[-1], last % block_size + 1 :] = float("nan")
        v_pool[table[-1], last % block_size + 1 :] = float("nan")
        for p in range(context_len - query_len, context_len):
            positions.append(p)
            slots.append(table[p // block_size] * block_size + p % block_size)
        cu_seqlens_q.append(len(positions))
    num_tokens = len(positions)
    as_device = dict(device=device)
    return AttentionCase(
        q=torch.randn(num_tokens, num_heads, head_dim, generator=generator).to(dtype).to(**as_device),
        k=torch.randn(num_tokens, num_kv_heads, head_dim, generator=generator).to(dtype).to(**as_device),
        v=torch.randn(num_tokens, num_kv_heads, head_dim, generator=generator).to(dtype).to(**as_device),
        k_pool=k_pool.to(**as_device),
        v_pool=v_pool.to(**as_device),
        block_tables=block_tables.to(**as_device),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        positions=torch.tensor(positions, dtype=torch.int64, device=device),
        cu_seqlens_q=cu_seqlens_q,
        context_lens=list(context_lens),
        scale=head_dim**-0.5,
    )


def _cache_for(case: AttentionCase) -> KVCache:
    num_blocks, block_size, num_kv_heads, head_dim = case.k_pool.shape
    cache = KVCache(1, num_blocks, block_size, num_kv_heads, head_dim, case.k_pool.dtype, case.k_pool.device)
    cache.k[0].copy_(case.k_pool)
    cache.v[0].copy_(case.v_pool)
    return cache


def run_attention(
    case: AttentionCase, use_kernels: bool, max_context_len: int | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The shard's PagedAttention layer (store K/V, then attend) on a copy of the case's pools, through the
    torch reference or the kernels; returns (out, k_pool, v_pool)."""
    cache = _cache_for(case)
    num_heads, head_dim = case.q.shape[1:]
    layer = PagedAttention(0, num_heads, case.k_pool.shape[2], head_dim, case.scale)
    layer.backend = Backend.CUDA if use_kernels else Backend.TORCH
    ctx = ForwardContext(
        kv_cache=cache,
        cu_seqlens_q=case.cu_seqlens_q,
        context_lens=case.context_lens,
        block_tables=case.block_tables,
        slot_mapping=case.slot_mapping,
        positions=case.positions,
        kernels=case.metadata(max_context_len) if use_kernels else None,
    )
    with torch.inference_mode(), forward_context(ctx):
        out = layer(case.q, case.k, case.v)
    return out, cache.k[0], cache.v[0]


def run_attention_poisoned(case: AttentionCase, num_splits: int | None = None) -> torch.Tensor:
    """The attention kernel alone (pool already holding the new K/V) into a NaN-poisoned output."""
    cache = _cache_for(case)
    kernels.store_kv(case.k, case.v, cache.k[0], cache.v[0], case.slot_mapping)
    meta = case.metadata()
    out = torch.full_like(case.q, float("nan"))
    ext = kernels.load()
    if case.is_decode:
        num_seqs, num_heads, head_dim = case.q.shape
        if num_splits is None:
            sms = kernels.num_sms(case.q.device.index or 0)
            num_splits = kernels.decode_num_splits(num_seqs, case.k_pool.shape[2], meta.max_context_len, sms)
        nan, device = float("nan"), case.q.device
        partial_out = torch.full((num_seqs, num_heads, num_splits, head_dim), nan, device=device)
        partial_lse = torch.full((num_seqs, num_heads, num_splits), nan, device=device)
        ext.paged_decode_attention(
            out, case.q, cache.k[0], cache.v[0], case.block_tables, meta.context_lens, case.scale, num_splits,
            partial_out, partial_lse,
        )  # fmt: skip
    else:
        ext.paged_prefill_attention(
            out, case.q, cache.k[0], cache.v[0], case.block_tables, meta.context_lens, meta.cu_seqlens_q,
            case.positions, case.scale, meta.max_query_len,
        )  # fmt: skip
    return out


def max_relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |a - e| / max |e| over the whole tensor, in float32 (NaN anywhere in `actual`: inf)."""
    actual, expected = actual.float(), expected.float()
    if torch.isnan(actual).any():
        return float("inf")
    return ((actual - expected).abs().max() / expected.abs().max().clamp_min(1e-30)).item()
