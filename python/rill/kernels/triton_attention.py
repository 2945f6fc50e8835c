"""Paged attention as Triton kernels: `paged_attention`, the GPU's `KernelOps.paged_attention`.

Contract (see `KernelOps.paged_attention` for the semantics):

- Layouts. q [num_tokens, num_heads, head_dim]; K and V pools [num_blocks, block_size, num_kv_heads, head_dim]
  (any strides; block 0 is the null block, which may hold garbage); block_tables int64 [num_seqs, max_blocks];
  positions int64 [num_tokens]; cu_seqlens_q int32 [num_seqs + 1]; context_lens int32 [num_seqs]. The result
  is [num_tokens, num_heads, head_dim] in q's dtype. Pools in float32, bfloat16 or float16; q is cast to the
  pools' dtype. head_dim any multiple of 16 up to 256 (tiles pad it to a power of two, masked); block sizes
  any power of two; GQA groups (num_heads / num_kv_heads) up to BLOCK_M. Partial split states of a decode
  call: float32 [num_tokens, num_heads, splits, head_dim padded] + [.., 2] (max, sum), allocated per call,
  splits = ceil(max_context_len / SPLIT_KEYS).
- Work. One program takes a tile of BLOCK_M rows of one sequence and one KV head, a row being a (query,
  query head of the KV head's group) pair, query-major: every query head of a group shares each K/V tile.
  It walks the keys in fixed splits of SPLIT_KEYS keys (split s: keys [s * SPLIT_KEYS, (s + 1) *
  SPLIT_KEYS)), each split in tiles of BLOCK_N keys from the split's start, with an online softmax started
  afresh in each split. Rounding points: scores = dot(q, k) in float32 (tensor cores for 16-bit pools; IEEE
  float32 for float32 pools, not TF32, so no tensor cores), times `scale`; soft-capped as softcap * tanh(
  score / softcap), tanh through exp; masked to -inf outside [position - sliding_window + 1, position];
  probabilities exp(score - max) in float32, rounded to the pools' dtype for the dot with V, accumulated in
  float32. A split's state (max m, sum l, unnormalised accumulator) is merged into the row's total in split
  order by `_merge_split`; the output is total accumulator / total sum, rounded once to q's dtype.
  Decode (every sequence one query: `meta.is_decode`) runs one program per split and writes each split's
  state (float32) to memory; a second kernel merges them with the same `_merge_split`. Prefill and mixed
  batches merge the splits inside the program. So both paths do the same float operations per row.
- Reads. A program reads only keys in [first visible key of its first row, min(context_len, position of its
  last row + 1)): block-table entries and pool slots outside are never loaded (masked loads give zeros),
  so released window blocks (the null block), padded table entries and slots past a context may hold NaN.
- Batch invariance. Tile sizes and warps (`tile_sizes`) depend on head_dim only, SPLIT_KEYS is a constant, and
  split and tile boundaries are fixed key positions, never derived from the batch. A row's value depends on
  the other rows of its tile only through which keys are loaded, and a key outside the row's causal window
  scores -inf: a tile or split with no visible key leaves the row's state bitwise unchanged (its
  probabilities are exactly 0, rescales exactly 1, or the state stays m = -inf, l = 0, acc = 0), and a
  loaded key the row does not see adds exactly 0. Hence a query's bits do not depend on the other sequences
  of the batch, on how its sequence is chunked, nor on whether it runs as a decode row (split kernel + merge
  kernel) or inside a prefill tile (in-program merge): the tests check all three bitwise under the
  interpreter, whose `tl.dot` the tests replace by an order-fixed float32 sum (numpy's BLAS is not
  row-invariant). On a GPU this rests on a dot's output element not depending on its row's place in the
  tile nor on the other rows (true of mma.sync / wgmma for a fixed tile shape, and decode and prefill use
  the same one) and on both merge paths compiling `_merge_split` alike (the same FMA contractions: Triton
  fuses by default); unchecked until a GPU is lent. Not invariant: anything across head dims or Triton
  versions (other tiles, other code). The result differs from the torch
  reference `tiled_causal_attention` (256-key tiles, one online softmax, q scaled before the dot) by
  rounding only.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rill.kernels.ops import AttentionMetadata

SPLIT_KEYS = 512  # keys per split; a multiple of every BLOCK_N
MAX_HEAD_DIM = 256
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def tile_sizes(head_dim: int) -> tuple[int, int, int]:
    """(BLOCK_M rows, BLOCK_N keys, warps) per tile: a function of head_dim alone (batch invariance). 64 rows
    make one wgmma tile on sm_90 (mma.sync on sm_80); past 128 dims, fewer keys and more warps hold the
    float32 accumulator [64, head_dim] in registers."""
    return (64, 64, 4) if head_dim <= 128 else (64, 32, 8)


@triton.jit
def _merge_split(tot_m, tot_l, tot_acc, m, sum_p, acc):
    """Folds one split's state (max m, sum sum_p [rows], acc [rows, d]) into the running total, exactly as
    written here on both paths. A split with no visible key (m = -inf, sum_p = 0, acc = 0) leaves a finite
    total bitwise as is."""
    new_m = tl.maximum(tot_m, m)
    safe_m = tl.where(new_m == float("-inf"), 0.0, new_m)
    old_scale = tl.exp(tot_m - safe_m)
    new_scale = tl.exp(m - safe_m)
    tot_l = tot_l * old_scale + sum_p * new_scale
    tot_acc = tot_acc * old_scale[:, None] + acc * new_scale[:, None]
    return new_m, tot_l, tot_acc


@triton.jit
def _attend_split(
    q,
    row_pos,
    row_valid,
    k_base,
    v_base,
    table_base,
    key_lo,
    key_hi,
    first_key,
    key_end,
    scale,
    softcap,
    window,
    stride_kb,
    stride_ks,
    stride_vb,
    stride_vs,
    offs_d,
    d_mask,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    USE_SOFTCAP: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """One split's online softmax over key tiles [key_lo, key_hi) (key_lo a multiple of BLOCK_N); keys read
    only in [first_key, key_end). Returns (m, l, acc) of the split, unnormalised."""
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32)
    for tile_start in range(key_lo, key_hi, BLOCK_N):
        keys = tile_start + tl.arange(0, BLOCK_N)
        key_read = (keys >= first_key) & (keys < key_end)
        block = tl.load(table_base + keys // BLOCK_SIZE, mask=key_read, other=0)
        slot = keys % BLOCK_SIZE
        k_offsets = block[None, :] * stride_kb + slot[None, :] * stride_ks + offs_d[:, None]
        k_t = tl.load(k_base + k_offsets, mask=key_read[None, :] & d_mask[:, None], other=0.0)
        scores = tl.dot(q, k_t, input_precision=DOT_PRECISION) * scale  # [BLOCK_M, BLOCK_N]
        if USE_SOFTCAP:
            # tanh(x) = 1 - 2 / (exp(2x) + 1): exact at both infinities, no tanh needed from the backend.
            scores = softcap * (1.0 - 2.0 / (tl.exp(2.0 * (scores / softcap)) + 1.0))
        visible = (keys[None, :] <= row_pos[:, None]) & key_read[None, :] & row_valid[:, None]
        if USE_WINDOW:
            visible = visible & (keys[None, :] > row_pos[:, None] - window)
        scores = tl.where(visible, scores, float("-inf"))
        new_m = tl.maximum(m_i, tl.max(scores, 1))
        safe_m = tl.where(new_m == float("-inf"), 0.0, new_m)
        rescale = tl.exp(m_i - safe_m)
        p = tl.exp(scores - safe_m[:, None])
        l_i = l_i * rescale + tl.sum(p, 1)
        v_offsets = block[:, None] * stride_vb + slot[:, None] * stride_vs + offs_d[None, :]
        v = tl.load(v_base + v_offsets, mask=key_read[:, None] & d_mask[None, :], other=0.0)
        acc = tl.dot(p.to(v.dtype), v, acc * rescale[:, None], input_precision=DOT_PRECISION)
        m_i = new_m
    return m_i, l_i, acc


@triton.jit
def _paged_attention_tiles(
    out,
    part_acc,
    part_ml,
    q_ptr,
    k_pool,
    v_pool,
    block_tables,
    cu_seqlens_q,
    context_lens,
    positions,
    scale,
    softcap,
    window,
    num_q_tiles,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_bt,
    stride_pt,
    stride_ph,
    stride_ps,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    SPLIT_KEYS: tl.constexpr,
    SPLIT_OUTPUT: tl.constexpr,
    USE_SOFTCAP: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Grid (num_seqs * num_q_tiles, num_kv_heads, splits): SPLIT_OUTPUT (decode) writes split
    program_id(2)'s state to part_acc / part_ml; otherwise (one split per grid) merges all splits in-program
    and writes `out`."""
    seq = tl.program_id(0) // num_q_tiles
    q_tile = tl.program_id(0) % num_q_tiles
    kv_head = tl.program_id(1)
    q_start = tl.load(cu_seqlens_q + seq)
    query_len = tl.load(cu_seqlens_q + seq + 1) - q_start
    context_len = tl.load(context_lens + seq)

    rows = q_tile * BLOCK_M + tl.arange(0, BLOCK_M)
    row_valid = rows < query_len * GROUP
    token = (q_start + rows // GROUP).to(tl.int64)
    head = kv_head * GROUP + rows % GROUP
    row_pos = tl.load(positions + token, mask=row_valid, other=0)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    d_mask = offs_d < HEAD_DIM
    q_offsets = token[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptr + q_offsets, mask=row_valid[:, None] & d_mask[None, :], other=0.0)
    q = q.to(k_pool.dtype.element_ty)

    # The keys this tile may read: [first_key, key_end); none when it holds no row.
    last_pos = tl.max(tl.where(row_valid, row_pos, -1), 0)
    key_end = tl.minimum(context_len, last_pos + 1)
    first_key = 0
    if USE_WINDOW:
        first_pos = tl.min(tl.where(row_valid, row_pos, last_pos), 0)
        first_key = tl.maximum(first_pos - window + 1, 0)
    first_tile = first_key // BLOCK_N * BLOCK_N

    k_base = k_pool + kv_head * stride_kh
    v_base = v_pool + kv_head * stride_vh
    table_base = block_tables + seq.to(tl.int64) * stride_bt
    if SPLIT_OUTPUT:
        split = tl.program_id(2)
        key_lo = tl.maximum(split * SPLIT_KEYS, first_tile)
        key_hi = tl.minimum((split + 1) * SPLIT_KEYS, key_end)
        m, sum_p, acc = _attend_split(
            q, row_pos, row_valid, k_base, v_base, table_base, key_lo, key_hi, first_key, key_end,
            scale, softcap, window, stride_kb, stride_ks, stride_vb, stride_vs, offs_d, d_mask,
            BLOCK_M, BLOCK_N, HEAD_DIM_PAD, BLOCK_SIZE, USE_SOFTCAP, USE_WINDOW, DOT_PRECISION,
        )  # fmt: skip
        part = token * stride_pt + head * stride_ph + split * stride_ps
        tl.store(part_acc + part[:, None] * HEAD_DIM_PAD + offs_d[None, :], acc, mask=row_valid[:, None])
        tl.store(part_ml + part * 2, m, mask=row_valid)
        tl.store(part_ml + part * 2 + 1, sum_p, mask=row_valid)
    else:
        tot_m = tl.full([BLOCK_M], float("-inf"), tl.float32)
        tot_l = tl.zeros([BLOCK_M], tl.float32)
        tot_acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32)
        for split_start in range(first_key // SPLIT_KEYS * SPLIT_KEYS, key_end, SPLIT_KEYS):
            key_lo = tl.maximum(split_start, first_tile)
            key_hi = tl.minimum(split_start + SPLIT_KEYS, key_end)
            m, sum_p, acc = _attend_split(
                q, row_pos, row_valid, k_base, v_base, table_base, key_lo, key_hi, first_key, key_end,
                scale, softcap, window, stride_kb, stride_ks, stride_vb, stride_vs, offs_d, d_mask,
                BLOCK_M, BLOCK_N, HEAD_DIM_PAD, BLOCK_SIZE, USE_SOFTCAP, USE_WINDOW, DOT_PRECISION,
            )  # fmt: skip
            tot_m, tot_l, tot_acc = _merge_split(tot_m, tot_l, tot_acc, m, sum_p, acc)
        result = tot_acc / tl.where(row_valid, tot_l, 1.0)[:, None]
        o_offsets = token[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :]
        tl.store(out + o_offsets, result.to(out.dtype.element_ty), mask=row_valid[:, None] & d_mask[None, :])


@triton.jit
def _merge_decode_splits(
    out,
    part_acc,
    part_ml,
    cu_seqlens_q,
    context_lens,
    positions,
    window,
    num_heads,
    stride_ot,
    stride_oh,
    stride_pt,
    stride_ph,
    stride_ps,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    SPLIT_KEYS: tl.constexpr,
    USE_WINDOW: tl.constexpr,
):
    """Grid (num_seqs,): a sequence's decode token merges the splits its keys fall in, every head at once."""
    seq = tl.program_id(0)
    token = tl.load(cu_seqlens_q + seq).to(tl.int64)
    has_query = tl.load(cu_seqlens_q + seq + 1) > token
    pos = tl.load(positions + tl.where(has_query, token, 0))  # token 0 exists: the batch is not empty
    key_end = tl.where(has_query, tl.minimum(tl.load(context_lens + seq), pos + 1), 0)
    first_key = 0
    if USE_WINDOW:
        first_key = tl.maximum(pos - window + 1, 0)
    heads = tl.arange(0, HEADS_PAD)
    head_valid = heads < tl.where(has_query, num_heads, 0)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    tot_m = tl.full([HEADS_PAD], float("-inf"), tl.float32)
    tot_l = tl.zeros([HEADS_PAD], tl.float32)
    tot_acc = tl.zeros([HEADS_PAD, HEAD_DIM_PAD], tl.float32)
    for split in range(first_key // SPLIT_KEYS, tl.cdiv(key_end, SPLIT_KEYS)):
        part = token * stride_pt + heads * stride_ph + split * stride_ps
        m = tl.load(part_ml + part * 2, mask=head_valid, other=float("-inf"))
        sum_p = tl.load(part_ml + part * 2 + 1, mask=head_valid, other=0.0)
        acc = tl.load(
            part_acc + part[:, None] * HEAD_DIM_PAD + offs_d[None, :], mask=head_valid[:, None], other=0.0
        )
        tot_m, tot_l, tot_acc = _merge_split(tot_m, tot_l, tot_acc, m, sum_p, acc)
    result = tot_acc / tl.where(head_valid, tot_l, 1.0)[:, None]
    o_offsets = token * stride_ot + heads[:, None] * stride_oh + offs_d[None, :]
    tl.store(
        out + o_offsets,
        result.to(out.dtype.element_ty),
        mask=head_valid[:, None] & (offs_d < HEAD_DIM)[None, :],
    )


def unsupported(
    head_dim: int, num_heads: int, num_kv_heads: int, dtype: torch.dtype | None = None
) -> str | None:
    """Why `paged_attention` cannot serve this shape (None: it can); dtype None: the shape alone."""
    if head_dim % 16 != 0 or not 16 <= head_dim <= MAX_HEAD_DIM:
        return f"head_dim {head_dim} is not a multiple of 16 in [16, {MAX_HEAD_DIM}]"
    if num_heads % num_kv_heads != 0 or num_heads // num_kv_heads > tile_sizes(head_dim)[0]:
        max_group = tile_sizes(head_dim)[0]
        return f"{num_heads} query heads over {num_kv_heads} KV heads: not a group of at most {max_group}"
    if dtype is not None and dtype not in _DTYPES:
        return f"pools in {dtype}: only float32, bfloat16 and float16"
    return None


def paged_attention(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int = 0,
    softcap: float = 0.0,
) -> torch.Tensor:
    """`KernelOps.paged_attention` (see the module's contract). No host sync: grids come from tensor shapes
    and the metadata's host bounds."""
    num_tokens, num_heads, head_dim = q.shape
    num_blocks, block_size, num_kv_heads, _ = v_pool.shape
    reason = unsupported(head_dim, num_heads, num_kv_heads, v_pool.dtype)
    if reason is not None:
        raise ValueError(reason)
    if k_pool.shape != v_pool.shape or k_pool.dtype != v_pool.dtype:
        raise ValueError(f"K pool {tuple(k_pool.shape)} {k_pool.dtype} is not V's {tuple(v_pool.shape)}")
    if k_pool.stride(-1) != 1 or v_pool.stride(-1) != 1 or q.stride(-1) != 1:
        raise ValueError("q and the pools need a unit stride along head_dim")
    group = num_heads // num_kv_heads
    block_m, block_n, num_warps = tile_sizes(head_dim)
    head_dim_pad = triton.next_power_of_2(head_dim)
    num_seqs = meta.context_lens.shape[0]
    out = torch.empty_like(q)
    if num_tokens == 0 or num_seqs == 0:
        return out
    num_q_tiles = triton.cdiv(meta.max_query_len * group, block_m)
    common = dict(
        GROUP=group,
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=head_dim_pad,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_SIZE=block_size,
        SPLIT_KEYS=SPLIT_KEYS,
        USE_SOFTCAP=softcap > 0.0,
        USE_WINDOW=sliding_window > 0,
        DOT_PRECISION="ieee" if v_pool.dtype == torch.float32 else "tf32",
    )
    window = max(sliding_window, 0)
    cap = softcap if softcap > 0.0 else 1.0
    tables = meta.block_tables
    if meta.is_decode:
        num_splits = max(triton.cdiv(meta.max_context_len, SPLIT_KEYS), 1)
        part_acc = torch.empty(
            num_tokens, num_heads, num_splits, head_dim_pad, dtype=torch.float32, device=q.device
        )
        part_ml = torch.empty(num_tokens, num_heads, num_splits, 2, dtype=torch.float32, device=q.device)
        part_strides = (num_heads * num_splits, num_splits, 1)  # in units of one split's state
    else:
        num_splits = 1
        part_acc = part_ml = out  # not written
        part_strides = (0, 0, 0)
    _paged_attention_tiles[(num_seqs * num_q_tiles, num_kv_heads, num_splits)](
        out, part_acc, part_ml, q, k_pool, v_pool, tables,
        meta.cu_seqlens_q, meta.context_lens, meta.positions, scale, cap, window, num_q_tiles,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_pool.stride(0), k_pool.stride(1), k_pool.stride(2),
        v_pool.stride(0), v_pool.stride(1), v_pool.stride(2),
        tables.stride(0), *part_strides,
        SPLIT_OUTPUT=meta.is_decode, num_warps=num_warps, **common,
    )  # fmt: skip
    if meta.is_decode:
        _merge_decode_splits[(num_seqs,)](
            out, part_acc, part_ml, meta.cu_seqlens_q, meta.context_lens, meta.positions, window, num_heads,
            out.stride(0), out.stride(1), *part_strides,
            HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad, HEADS_PAD=triton.next_power_of_2(num_heads),
            SPLIT_KEYS=SPLIT_KEYS, USE_WINDOW=sliding_window > 0,
        )  # fmt: skip
    return out
