"""Random paged-attention cases and the ways to run them (torch reference / kernel ops), shared by the kernel
tests (tests/shard/test_kernels.py, tests/shard/test_cpu_kernels.py) and bench/gpu_check.py.

A case scatters each sequence's blocks over the pool in random order, pads block tables with the null block 0,
and poisons (NaN) block 0 and every slot past a sequence's context, so a kernel that reads a padded or unused
slot produces NaN instead of a plausible number. `run_attention_poisoned` poisons the memory the output is
likely to get too.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from rill.kernels.ops import AttentionMetadata, KernelOps
from rill.shard.kv_cache import KVCache
from rill.shard.layers.attention import ForwardContext, PagedAttention, forward_context


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

    def metadata(self, max_context_len: int | None = None) -> AttentionMetadata:
        meta = AttentionMetadata.build(
            self.cu_seqlens_q, self.context_lens, self.block_tables, self.slot_mapping, self.positions
        )
        return meta if max_context_len is None else dataclasses.replace(meta, max_context_len=max_context_len)


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
    case: AttentionCase,
    ops: KernelOps | None,
    max_context_len: int | None = None,
    *,
    sliding_window: int = 0,
    softcap: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The shard's PagedAttention layer (store K/V, then attend) on a copy of the case's pools, through the
    torch reference (ops None) or the kernel ops; returns (out, k_pool, v_pool)."""
    cache = _cache_for(case)
    num_heads, head_dim = case.q.shape[1:]
    layer = PagedAttention(0, num_heads, case.k_pool.shape[2], head_dim, case.scale, sliding_window, softcap)
    layer.use_ops(ops)
    ctx = ForwardContext(cache, case.metadata(max_context_len))
    with torch.inference_mode(), forward_context(ctx):
        out = layer(case.q, case.k, case.v)
    return out, cache.k[0], cache.v[0]


def run_attention_poisoned(case: AttentionCase, ops: KernelOps) -> torch.Tensor:
    """The ops' attention alone (the pool already holding the new K/V, written by `ops.store_kv`), its output
    likely landing on NaN: a NaN-filled tensor of the output's size is freed just before the call, so a
    caching allocator (torch's on CUDA) hands that memory to the output the op allocates, and an element the
    kernel fails to write stays NaN."""
    cache = _cache_for(case)
    ops.store_kv(case.k, case.v, cache.k[0], cache.v[0], case.slot_mapping)
    meta = case.metadata()
    poison = torch.full_like(case.q, float("nan"))
    del poison
    return ops.paged_attention(case.q, cache.k[0], cache.v[0], meta, case.scale)


def plain_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    scale: float,
    window: int,
    softcap: float,
) -> torch.Tensor:
    """Softmax attention of one sequence in float64, spelled out: causal mask, sliding window, softcap."""
    group = q.shape[1] // k.shape[1]
    k = k.double().repeat_interleave(group, dim=1)
    v = v.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double() * scale, k)
    if softcap > 0:
        scores = softcap * torch.tanh(scores / softcap)
    key_positions = torch.arange(k.shape[0])
    hidden = key_positions[None, :] > positions[:, None]
    if window > 0:
        hidden |= key_positions[None, :] <= positions[:, None] - window
    probs = scores.masked_fill(hidden, float("-inf")).softmax(dim=-1)
    return torch.einsum("hqk,khd->qhd", probs, v)


def max_relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |a - e| / max |e| over the whole tensor, in float32 (NaN anywhere in `actual`: inf)."""
    actual, expected = actual.float(), expected.float()
    if torch.isnan(actual).any():
        return float("inf")
    return ((actual - expected).abs().max() / expected.abs().max().clamp_min(1e-30)).item()
