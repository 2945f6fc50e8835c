"""Rill's Triton kernels for what a GPU decode step runs outside attention and the GEMMs: the KV write, fused
add + RMSNorm, rotary, SiLU-and-mul, the sampler's row reductions and LoRA's per-row adapter product.
`rill.kernels.gpu.GpuOps` calls them; each `launch_*` function below takes torch tensors and launches one
kernel, or two for LoRA (Triton compiles each per shape class on first use).

The same source runs three ways: compiled for the GPU; under Triton's interpreter (`TRITON_INTERPRET=1` in the
environment before this module is imported) on CPU tensors, which is how CI executes it
(tests/shard/test_triton_ops.py); and compiled ahead of time for sm_80 / sm_90 without a device
(.ci/compile_triton.py).

Contract, for every kernel here:
- Arithmetic is float32: every 16-bit value is converted to float32 when loaded and rounded (to nearest even)
  to its storage dtype exactly where the torch reference rounds, which the kernel names. (The interpreter has
  no 16-bit arithmetic of its own either.) Kernels are launched with `enable_fp_fusion=False`, so a product
  the reference rounds is never fused into a following add.
- One program per row (a token, a hidden row, a logits row); a row's result depends only on that row and its
  length, never on the batch: reductions go over fixed-size chunks (their size a function of the row length
  alone) in a fixed order. That is what makes each kernel batch-invariant.
- q/k/v rows are [num_tokens, heads, head_dim] with contiguous head dims and any head and token strides (views
  of the fused qkv output); other 2-D inputs are contiguous (the launchers make them so).
- No launcher synchronises with the host or allocates host memory, so each can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Every kernel rounds where its reference does; fusing a product into a later add would round once fewer.
LAUNCH_OPTIONS = dict(enable_fp_fusion=False)
ROW_CHUNK = 1024  # elements per step of the row reductions (argmax, softmax statistics)


def _warps(block: int) -> int:
    return 1 if block <= 256 else 4 if block <= 2048 else 8 if block <= 8192 else 16


@triton.jit
def _to_dtype(x, DTYPE: tl.constexpr):
    """float32 x rounded to nearest even in DTYPE. bfloat16 by its bits: the GPU's conversion rounds to
    nearest even, the interpreter's truncates, so the kernel rounds first and either conversion is then
    exact."""
    if DTYPE == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
        bits = tl.where(x != x, 0x7FC00000, bits)  # a NaN stays one (its low bits could carry into inf)
        return bits.to(tl.float32, bitcast=True).to(DTYPE)
    else:
        return x.to(DTYPE)


@triton.jit
def _round(x, DTYPE: tl.constexpr):
    """float32 x rounded to DTYPE and back: where the reference stores a value."""
    return _to_dtype(x, DTYPE).to(tl.float32)


@triton.jit
def _convert(x, DTYPE: tl.constexpr):
    """x in DTYPE, one rounding (as torch's `.to`)."""
    if x.dtype == DTYPE:
        return x
    else:
        return _to_dtype(x.to(tl.float32), DTYPE)


# --- store_kv -----------------------------------------------------------------------------------------------
# k, v: [num_tokens, num_kv_heads, head_dim] (any token / head stride, contiguous dims); pools contiguous
# [num_slots, num_kv_heads, head_dim] (the [num_blocks, block_size, ...] pool viewed flat). Token t's rows go
# to slot slot_mapping[t], converted to the pool's dtype (one rounding, as `k.to(pool.dtype)`); a slot < 0 or
# >= num_slots writes nothing. One program per token; bitwise the reference (a copy and one conversion).


@triton.jit
def _store_kv_kernel(
    k_ptr,
    v_ptr,
    k_pool_ptr,
    v_pool_ptr,
    slot_ptr,
    num_slots,
    stride_k_token,
    stride_k_head,
    stride_v_token,
    stride_v_head,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    heads = tl.arange(0, BLOCK_H)[:, None]
    dims = tl.arange(0, BLOCK_D)[None, :]
    # The slot as a tensor of the tile's shape: the interpreter cannot broadcast a scalar mask.
    slots = slot + tl.zeros((BLOCK_H, BLOCK_D), tl.int64)
    mask = (heads < NUM_KV_HEADS) & (dims < HEAD_DIM) & (slots >= 0) & (slots < num_slots)
    pool_offsets = slot * (NUM_KV_HEADS * HEAD_DIM) + heads * HEAD_DIM + dims
    k = tl.load(k_ptr + token * stride_k_token + heads * stride_k_head + dims, mask=mask)
    tl.store(k_pool_ptr + pool_offsets, _convert(k, k_pool_ptr.dtype.element_ty), mask=mask)
    v = tl.load(v_ptr + token * stride_v_token + heads * stride_v_head + dims, mask=mask)
    tl.store(v_pool_ptr + pool_offsets, _convert(v, v_pool_ptr.dtype.element_ty), mask=mask)


def launch_store_kv(
    k: torch.Tensor, v: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    num_tokens, num_kv_heads, head_dim = k.shape
    if k.stride(2) != 1 or v.stride(2) != 1:
        raise ValueError("k and v must have contiguous head dims")
    if not (k_pool.is_contiguous() and v_pool.is_contiguous()) or k_pool.shape != v_pool.shape:
        raise ValueError("the K and V pools must be contiguous and of one shape")
    if k_pool.shape[-2:] != (num_kv_heads, head_dim) or v.shape != k.shape:
        raise ValueError(f"k/v {tuple(k.shape)} do not fit pools {tuple(k_pool.shape)}")
    if num_tokens == 0:
        return
    num_slots = k_pool.numel() // (num_kv_heads * head_dim)
    block_h, block_d = triton.next_power_of_2(num_kv_heads), triton.next_power_of_2(head_dim)
    _store_kv_kernel[(num_tokens,)](
        k, v, k_pool, v_pool, slot_mapping, num_slots,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, BLOCK_H=block_h, BLOCK_D=block_d,
        num_warps=_warps(block_h * block_d), **LAUNCH_OPTIONS,
    )  # fmt: skip


# --- fused add + RMSNorm ------------------------------------------------------------------------------------
# x, residual, out, residual_out: contiguous [rows, hidden]; weight [hidden], all of one dtype. Rounding
# points, as rill/shard/layers/norm.py: s = x + residual rounded to the dtype (stored as residual_out: bitwise
# the reference); in float32, y = s * 1 / sqrt(mean(s^2) + eps) (a correctly rounded sqrt and division, as
# torch's rsqrt on the CPU) rounded to the dtype; out = weight * y rounded to the dtype. Only the order of the
# sum of squares differs from the reference: BLOCK (the next power of two >= hidden) lanes summed by one tree.


@triton.jit
def _fused_add_rms_norm_kernel(
    out_ptr,
    residual_out_ptr,
    x_ptr,
    residual_ptr,
    weight_ptr,
    eps,
    HIDDEN: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < HIDDEN
    dtype = x_ptr.dtype.element_ty
    s = tl.load(x_ptr + row * HIDDEN + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        residual = tl.load(residual_ptr + row * HIDDEN + cols, mask=mask, other=0.0).to(tl.float32)
        s = _round(s + residual, dtype)
        tl.store(residual_out_ptr + row * HIDDEN + cols, _to_dtype(s, dtype), mask=mask)
    mean_square = tl.sum(s * s, axis=0) / HIDDEN
    inverse_rms = tl.div_rn(1.0, tl.sqrt_rn(mean_square + eps))
    y = _round(s * inverse_rms, dtype)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * HIDDEN + cols, _to_dtype(weight * y, dtype), mask=mask)


def launch_fused_add_rms_norm(
    out: torch.Tensor,
    residual_out: torch.Tensor,
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
) -> None:
    """The `kernel(out, residual_out, x, residual, weight, eps)` that `ops.run_fused_add_rms_norm` calls."""
    num_rows, hidden = x.shape
    if weight.dtype != x.dtype or (residual is not None and residual.dtype != x.dtype):
        raise ValueError(f"x, residual and weight must share one dtype, not {x.dtype} / {weight.dtype}")
    if num_rows == 0:
        return
    block = triton.next_power_of_2(hidden)
    _fused_add_rms_norm_kernel[(num_rows,)](
        out, residual_out, x, x if residual is None else residual, weight, eps,
        HIDDEN=hidden, HAS_RESIDUAL=residual is not None, BLOCK=block,
        num_warps=_warps(block), **LAUNCH_OPTIONS,
    )  # fmt: skip


# --- rotary -------------------------------------------------------------------------------------------------
# q [num_tokens, num_heads, head_dim], k [num_tokens, num_kv_heads, head_dim] rotated in place (rotate-half)
# by cos, sin contiguous [num_tokens, head_dim / 2] in q's dtype. With x1, x2 the two halves of a row and c, s
# the token's table, the reference `x * cat(c, c) + cat(-x2, x1) * cat(s, s)` rounds each product and the sum
# to the dtype: x1' = r(r(x1 c) - r(x2 s)), x2' = r(r(x2 c) + r(x1 s)), r rounding to the dtype. The kernel
# rounds at exactly these points, so it is bitwise the reference. One program per token, heads in tiles of
# BLOCK_H.


@triton.jit
def _rotate_heads(
    x_ptr,
    token,
    stride_token,
    stride_head,
    cos,
    sin,
    NUM_HEADS: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    dtype = x_ptr.dtype.element_ty
    dims = tl.arange(0, BLOCK_HALF)[None, :]
    for first_head in range(0, NUM_HEADS, BLOCK_H):
        heads = first_head + tl.arange(0, BLOCK_H)[:, None]
        mask = (heads < NUM_HEADS) & (dims < HALF)
        first = x_ptr + token * stride_token + heads * stride_head + dims
        x1 = tl.load(first, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(first + HALF, mask=mask, other=0.0).to(tl.float32)
        out1 = _round(x1 * cos, dtype) - _round(x2 * sin, dtype)
        out2 = _round(x2 * cos, dtype) + _round(x1 * sin, dtype)
        tl.store(first, _to_dtype(out1, dtype), mask=mask)
        tl.store(first + HALF, _to_dtype(out2, dtype), mask=mask)


@triton.jit
def _rotary_kernel(
    q_ptr,
    k_ptr,
    cos_ptr,
    sin_ptr,
    stride_q_token,
    stride_q_head,
    stride_k_token,
    stride_k_head,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    dims = tl.arange(0, BLOCK_HALF)[None, :]
    cos = tl.load(cos_ptr + token * HALF + dims, mask=dims < HALF, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + token * HALF + dims, mask=dims < HALF, other=0.0).to(tl.float32)
    _rotate_heads(q_ptr, token, stride_q_token, stride_q_head, cos, sin, NUM_HEADS, HALF, BLOCK_H, BLOCK_HALF)
    _rotate_heads(
        k_ptr, token, stride_k_token, stride_k_head, cos, sin, NUM_KV_HEADS, HALF, BLOCK_H, BLOCK_HALF
    )


def launch_rotary_embedding(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    num_tokens, num_heads, head_dim = q.shape
    half = head_dim // 2
    if q.stride(2) != 1 or k.stride(2) != 1 or k.shape[2] != head_dim or k.dtype != q.dtype:
        raise ValueError("q and k must share head_dim and dtype, with contiguous head dims")
    if cos.shape != (num_tokens, half) or sin.shape != cos.shape or cos.dtype != q.dtype:
        raise ValueError(f"cos/sin must be [{num_tokens}, {half}] in {q.dtype}, not {tuple(cos.shape)}")
    if num_tokens == 0:
        return
    block_half = triton.next_power_of_2(half)
    block_h = max(1, min(triton.next_power_of_2(max(num_heads, k.shape[1])), 4096 // block_half))
    _rotary_kernel[(num_tokens,)](
        q, k, cos.contiguous(), sin.contiguous(), q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        NUM_HEADS=num_heads, NUM_KV_HEADS=k.shape[1], HALF=half, BLOCK_H=block_h, BLOCK_HALF=block_half,
        num_warps=_warps(block_h * block_half), **LAUNCH_OPTIONS,
    )  # fmt: skip


# --- SiLU-and-mul -------------------------------------------------------------------------------------------
# x contiguous [rows, 2 * I] = [gate | up] -> out [rows, I]: silu(gate) = gate / (1 + exp(-gate)) in float32,
# rounded to the dtype (torch's `silu` output), times up, rounded to the dtype. exp is Triton's (the GPU's
# fast exp), so equal to the reference within a few ulp in float32, not bitwise. Programs: (row, chunk of I).


@triton.jit
def _silu_and_mul_kernel(out_ptr, x_ptr, INTERMEDIATE: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < INTERMEDIATE
    dtype = x_ptr.dtype.element_ty
    gate = tl.load(x_ptr + row * 2 * INTERMEDIATE + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * 2 * INTERMEDIATE + INTERMEDIATE + cols, mask=mask, other=0.0).to(tl.float32)
    silu = _round(gate / (1.0 + tl.exp(-gate)), dtype)
    tl.store(out_ptr + row * INTERMEDIATE + cols, _to_dtype(silu * up, dtype), mask=mask)


def launch_silu_and_mul(out: torch.Tensor, x: torch.Tensor) -> None:
    num_rows, width = x.shape
    intermediate = width // 2
    if num_rows == 0 or intermediate == 0:
        return
    block = min(triton.next_power_of_2(intermediate), 2048)
    _silu_and_mul_kernel[(num_rows, triton.cdiv(intermediate, block))](
        out, x, INTERMEDIATE=intermediate, BLOCK=block, num_warps=_warps(block), **LAUNCH_OPTIONS
    )


# --- the sampler's row reductions ---------------------------------------------------------------------------
# float32 x contiguous [rows, n], one program per row walking it in chunks of ROW_CHUNK.
# argmax_rows: torch's `x.max(dim=-1).indices`: the first NaN if the row has one, else the first maximum
# (an all -inf row: 0). Exact (comparisons only), so bitwise torch's.
# softmax_stats: the row max (NaN if the row has a NaN), then sum(exp(x - max)) in float32 lanes, one lane per
# position mod ROW_CHUNK, summed by one tree at the end; log of it. As the reference, a row whose max is +-inf
# gets a NaN log-sum. Within float32 rounding of torch's log_softmax (exp, log and the sum order differ).


@triton.jit
def _argmax_rows_kernel(out_ptr, x_ptr, n, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    lanes = tl.arange(0, BLOCK)
    none = n  # an index past the row: "not found"
    best_value = -float("inf")
    best_index = none
    first_nan = none
    for start in range(0, n, BLOCK):
        index = start + lanes
        mask = index < n
        x = tl.load(x_ptr + row * n + index, mask=mask, other=-float("inf"))
        is_nan = x != x
        first_nan = tl.minimum(first_nan, tl.min(tl.where(is_nan & mask, index, none), axis=0))
        chunk_max = tl.max(tl.where(is_nan, -float("inf"), x), axis=0)
        chunk_index = tl.min(tl.where(mask & (x == chunk_max), index, none), axis=0)
        # Strictly greater: an equal maximum in a later chunk is not the first.
        is_better = (chunk_max > best_value) | ((best_index == none) & (chunk_index < none))
        best_index = tl.where(is_better, chunk_index, best_index)
        best_value = tl.where(is_better, chunk_max, best_value)
    tl.store(out_ptr + row, tl.where(first_nan < none, first_nan, best_index).to(tl.int64))


@triton.jit
def _softmax_stats_kernel(max_ptr, log_sum_ptr, x_ptr, n, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    lanes = tl.arange(0, BLOCK)
    lane_max = tl.full((BLOCK,), -float("inf"), tl.float32)
    lane_has_nan = tl.zeros((BLOCK,), tl.int32)
    for start in range(0, n, BLOCK):
        index = start + lanes
        x = tl.load(x_ptr + row * n + index, mask=index < n, other=-float("inf"))
        lane_has_nan = lane_has_nan | (x != x).to(tl.int32)
        lane_max = tl.maximum(lane_max, tl.where(x != x, -float("inf"), x))
    row_max = tl.max(lane_max, axis=0)
    row_max = tl.where(tl.max(lane_has_nan, axis=0) > 0, float("nan"), row_max)
    lane_sum = tl.zeros((BLOCK,), tl.float32)
    for start in range(0, n, BLOCK):
        index = start + lanes
        mask = index < n
        x = tl.load(x_ptr + row * n + index, mask=mask, other=0.0)
        lane_sum += tl.where(mask, tl.exp(x - row_max), 0.0)
    tl.store(max_ptr + row, row_max)
    tl.store(log_sum_ptr + row, tl.log(tl.sum(lane_sum, axis=0)))


def _check_rows(x: torch.Tensor) -> None:
    if x.dim() != 2 or x.dtype != torch.float32:
        raise ValueError(f"the row reductions take float32 [rows, n], not {x.dtype} {tuple(x.shape)}")


def launch_argmax_rows(out: torch.Tensor, x: torch.Tensor) -> None:
    _check_rows(x)
    if x.shape[0] == 0:
        return
    if x.shape[1] == 0:
        raise ValueError("argmax of an empty row")
    _argmax_rows_kernel[(x.shape[0],)](out, x, x.shape[1], BLOCK=ROW_CHUNK, num_warps=4, **LAUNCH_OPTIONS)


def launch_softmax_stats(row_max: torch.Tensor, log_sum: torch.Tensor, x: torch.Tensor) -> None:
    _check_rows(x)
    if x.shape[0] == 0:
        return
    _softmax_stats_kernel[(x.shape[0],)](
        row_max, log_sum, x, x.shape[1], BLOCK=ROW_CHUNK, num_warps=4, **LAUNCH_OPTIONS
    )


# --- LoRA ---------------------------------------------------------------------------------------------------
# `KernelOps.lora_add` in two phases, as punica's shrink / expand: for each row r with slot s = row_slots[r]
# >= 0 (int32), h = lora_a[s] x[r] (lora_a [S, P * R, in]), then each output o of part p gets y[r, o] +=
# lora_b[s, o] . h[p * R : (p + 1) * R] (lora_b [S, out, R]); rows with slot -1 are not touched. All
# contiguous. Shrink: one program per (row, part): the part's R dots over `in`, LORA_CHUNK lanes of products
# summed along the input in chunk order, then one tree over the lanes; h rounded to the dtype (the
# reference's h is a tensor of it) and kept as float32 [rows, P * R]. Expand: one program per (row, block of
# outputs): each output one tree over its R products, rounded to the dtype, then added to y and rounded. A
# row's result depends only on it, its slot's weights, `in` and R: never on the batch or on which slot holds
# the adapter. Not the reference's summation order: float32 results agree to rounding, not bitwise.
LORA_CHUNK = 128  # inputs per step of the shrink
LORA_OUTPUTS = 64  # outputs per expand program


@triton.jit
def _lora_shrink_kernel(
    h_ptr,
    x_ptr,
    a_ptr,
    slot_ptr,
    IN: tl.constexpr,
    RANK: tl.constexpr,
    NUM_PARTS: tl.constexpr,
    RANK_PAD: tl.constexpr,
    CHUNK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    slot = tl.load(slot_ptr + row).to(tl.int64)
    if slot >= 0:
        ranks = tl.arange(0, RANK_PAD)[:, None]
        cols = tl.arange(0, CHUNK)[None, :]
        a_rows = a_ptr + (slot * NUM_PARTS * RANK + part * RANK + ranks) * IN
        lanes = tl.zeros((RANK_PAD, CHUNK), tl.float32)
        for start in range(0, IN, CHUNK):
            mask = (ranks < RANK) & (start + cols < IN)
            a = tl.load(a_rows + start + cols, mask=mask, other=0.0).to(tl.float32)
            x = tl.load(x_ptr + row * IN + start + cols, mask=start + cols < IN, other=0.0).to(tl.float32)
            lanes += a * x
        h = _round(tl.sum(lanes, axis=1), x_ptr.dtype.element_ty)
        r = tl.arange(0, RANK_PAD)
        tl.store(h_ptr + row * NUM_PARTS * RANK + part * RANK + r, h, mask=r < RANK)


@triton.jit
def _lora_expand_kernel(
    y_ptr,
    h_ptr,
    b_ptr,
    slot_ptr,
    end0,
    end1,
    OUT: tl.constexpr,
    RANK: tl.constexpr,
    NUM_PARTS: tl.constexpr,
    RANK_PAD: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + row).to(tl.int64)
    if slot >= 0:
        outputs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ranks = tl.arange(0, RANK_PAD)[None, :]
        part = (outputs >= end0).to(tl.int32) + (outputs >= end1).to(
            tl.int32
        )  # part_ends[:-1], padded by OUT
        mask = (outputs[:, None] < OUT) & (ranks < RANK)
        h = tl.load(h_ptr + row * NUM_PARTS * RANK + part[:, None] * RANK + ranks, mask=mask, other=0.0)
        b = tl.load(b_ptr + (slot * OUT + outputs[:, None]) * RANK + ranks, mask=mask, other=0.0)
        dtype = y_ptr.dtype.element_ty
        product = _round(tl.sum(b.to(tl.float32) * h, axis=1), dtype)
        y = tl.load(y_ptr + row * OUT + outputs, mask=outputs < OUT, other=0.0).to(tl.float32)
        tl.store(y_ptr + row * OUT + outputs, _to_dtype(y + product, dtype), mask=outputs < OUT)


def launch_lora_add(
    y: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    row_slots: torch.Tensor,
    part_ends: tuple[int, ...],
) -> None:
    """A slot >= S reads past the stacks (checking it would sync with the host): the caller's contract."""
    num_rows, in_features = x.shape
    num_slots, out_features, rank = lora_b.shape
    num_parts = len(part_ends)
    if not 1 <= num_parts <= 3 or part_ends[-1] != out_features or list(part_ends) != sorted(set(part_ends)):
        raise ValueError(f"part_ends {part_ends} must be 1 to 3 ascending ends, the last {out_features}")
    if lora_a.shape != (num_slots, num_parts * rank, in_features) or y.shape != (num_rows, out_features):
        raise ValueError(
            f"lora_a {tuple(lora_a.shape)}, lora_b {tuple(lora_b.shape)}, x {tuple(x.shape)} and y "
            f"{tuple(y.shape)} do not fit [S, P * R, in], [S, out, R], [rows, in], [rows, out]"
        )
    if (
        not all(t.is_contiguous() for t in (y, x, lora_a, lora_b, row_slots))
        or row_slots.dtype != torch.int32
    ):
        raise ValueError("lora_add needs contiguous tensors and int32 row_slots")
    if len({y.dtype, x.dtype, lora_a.dtype, lora_b.dtype}) != 1:
        raise ValueError("y, x, lora_a and lora_b must share one dtype")
    if num_rows == 0:
        return
    h = torch.empty(num_rows, num_parts * rank, dtype=torch.float32, device=x.device)
    rank_pad = triton.next_power_of_2(rank)
    _lora_shrink_kernel[(num_rows, num_parts)](
        h, x, lora_a, row_slots, IN=in_features, RANK=rank, NUM_PARTS=num_parts, RANK_PAD=rank_pad,
        CHUNK=LORA_CHUNK, num_warps=_warps(rank_pad * LORA_CHUNK), **LAUNCH_OPTIONS,
    )  # fmt: skip
    ends = [*part_ends[:-1], out_features, out_features]
    _lora_expand_kernel[(num_rows, triton.cdiv(out_features, LORA_OUTPUTS))](
        y, h, lora_b, row_slots, ends[0], ends[1], OUT=out_features, RANK=rank, NUM_PARTS=num_parts,
        RANK_PAD=rank_pad, BLOCK=LORA_OUTPUTS, num_warps=_warps(rank_pad * LORA_OUTPUTS), **LAUNCH_OPTIONS,
    )  # fmt: skip
