"""Rill's CPU kernels (rill/kernels/cpu.py) against the shard's torch references, and their batch invariance.

These run on every machine with a C++ compiler, CI included: the first test builds the library (about a minute
on 2 cores), later runs load it from ~/.cache/rill/kernels. Attention cases come from bench/kernel_cases.py:
blocks in random order, NaN in the null block and in every slot past a sequence's context.
Tolerances: float32 1e-5 relative (the kernel sums in another order than torch's matmuls), bfloat16 1e-2;
store_kv and rotary are bitwise (same roundings in the same order); RMSNorm's residual sum is bitwise, its
output differs only by the order of the sum of squares.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from rill.kernels import cpu
from rill.kernels.ops import AttentionMetadata
from rill.shard.kv_cache import KVCache
from rill.shard.layers.attention import tiled_causal_attention
from rill.shard.layers.norm import RMSNorm
from rill.shard.layers.rotary import RotaryEmbedding

from bench.kernel_cases import AttentionCase, make_case, max_relative_error, plain_attention

OPS = cpu.CpuOps()
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
# (query_lens, context_lens): decode rows, whole prefills, and decode rows mixed with prefill chunks over a
# cached prefix; contexts cross the kernel's 64-key tiles and the blocks.
BATCHES = {
    "decode": ([1, 1, 1, 1], [17, 64, 100, 33]),
    "prefill": ([40, 7, 70], [40, 7, 70]),
    "mixed": ([1, 30, 1, 12], [65, 30, 129, 50]),
}


def bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bit patterns, so NaN compares equal to the same NaN."""
    return t.view(torch.int32 if t.element_size() == 4 else torch.int16)


def in_kernel_layout(k_pool: torch.Tensor) -> torch.Tensor:
    """A K pool [num_blocks, block_size, num_kv_heads, head_dim] laid out as the kernels keep it (see
    `CpuOps.k_pool_shape`; bfloat16: [num_blocks, num_kv_heads, head_dim / 2, block_size, 2])."""
    num_blocks, block_size, num_kv_heads, head_dim = k_pool.shape
    if OPS.k_pool_shape(*k_pool.shape, k_pool.dtype) == k_pool.shape:
        return k_pool
    pairs = k_pool.view(num_blocks, block_size, num_kv_heads, head_dim // 2, 2)
    return pairs.permute(0, 2, 3, 1, 4).contiguous()


def as_rows(k_pool: torch.Tensor) -> torch.Tensor:
    """A K pool in the kernels' layout as [num_blocks, block_size, num_kv_heads, head_dim]."""
    if k_pool.dim() == 4:
        return k_pool
    num_blocks, num_kv_heads, pairs, block_size, _ = k_pool.shape
    return k_pool.permute(0, 3, 1, 2, 4).reshape(num_blocks, block_size, num_kv_heads, 2 * pairs)


def stored_pools(case: AttentionCase, use_kernel: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Copies of the case's pools with the new tokens' K/V written by the kernel (K in the kernels' layout)
    or by KVCache.store_kv."""
    if use_kernel:
        k_pool, v_pool = in_kernel_layout(case.k_pool.clone()), case.v_pool.clone()
        OPS.store_kv(case.k, case.v, k_pool, v_pool, case.slot_mapping)
        return k_pool, v_pool
    num_blocks, block_size, num_kv_heads, head_dim = case.k_pool.shape
    cache = KVCache(1, num_blocks, block_size, num_kv_heads, head_dim, case.k_pool.dtype, torch.device("cpu"))
    cache.k[0].copy_(case.k_pool)
    cache.v[0].copy_(case.v_pool)
    cache.store_kv(0, case.k, case.v, case.slot_mapping)
    return cache.k[0], cache.v[0]


def reference_attention(case: AttentionCase, k_pool: torch.Tensor, v_pool: torch.Tensor) -> torch.Tensor:
    """The shard's reference: each sequence's K/V gathered through its block table, tiled_causal_attention."""
    block_size = k_pool.shape[1]
    out = torch.empty_like(case.q)
    for i, context_len in enumerate(case.context_lens):
        start, end = case.cu_seqlens_q[i], case.cu_seqlens_q[i + 1]
        blocks = case.block_tables[i, : -(-context_len // block_size)]
        k = as_rows(k_pool)[blocks].flatten(0, 1)[:context_len]
        v = v_pool[blocks].flatten(0, 1)[:context_len]
        out[start:end] = tiled_causal_attention(
            case.q[start:end], k, v, case.positions[start:end], case.scale
        )
    return out


def kernel_attention(
    case: AttentionCase, k_pool: torch.Tensor, v_pool: torch.Tensor, **options: float
) -> torch.Tensor:
    return OPS.paged_attention(case.q, k_pool, v_pool, case.metadata(), case.scale, **options)


def metadata(tables: torch.Tensor, cu_seqlens_q: torch.Tensor, positions: torch.Tensor) -> AttentionMetadata:
    """The metadata of a batch given by its block tables, query boundaries and positions (a sequence's context
    ends at its last query's position)."""
    cu = [int(x) for x in cu_seqlens_q]
    context_lens = [int(positions[end - 1]) + 1 for end in cu[1:]]
    return AttentionMetadata.build(cu, context_lens, tables, torch.empty(0, dtype=torch.int64), positions)


def test_builds_into_the_cache_then_loads():
    assert OPS.unavailable_reason() is None, OPS.unavailable_reason()
    module = cpu.load()
    assert OPS.unavailable_reason() is None and cpu.sources().is_built()
    assert Path(module.__file__).parent == cpu.sources().build_dir()
    assert cpu.sources().build_dir().name.startswith("cpu-")


def test_a_cached_library_loads_without_a_compiler_and_a_missing_one_says_why(monkeypatch):
    cpu.load()
    monkeypatch.setattr(cpu.shutil, "which", lambda name: None)
    assert OPS.unavailable_reason() is None
    assert hasattr(cpu.load.__wrapped__(), "paged_attention")  # imported from the cache, nothing built
    monkeypatch.setattr(cpu.KernelSources, "is_built", lambda self: False)
    assert OPS.unavailable_reason() == "no C++ compiler (g++/c++) on PATH to build Rill's CPU kernels"
    with pytest.raises(RuntimeError, match="no C\\+\\+ compiler"):
        cpu.load.__wrapped__()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("batch", list(BATCHES))
@pytest.mark.parametrize("group", [1, 3, 4, 8])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("block_size", [8, 16, 32])  # bfloat16 K: in rows at 8, in pairs (where kept so) else
def test_attention_matches_the_reference(block_size, head_dim, group, batch, dtype):
    query_lens, context_lens = BATCHES[batch]
    case = make_case(
        query_lens, context_lens, 2 * group, 2, head_dim, block_size, dtype, device="cpu", seed=group
    )
    ref_k, ref_v = stored_pools(case, use_kernel=False)
    k_pool, v_pool = stored_pools(case, use_kernel=True)
    assert torch.equal(bits(as_rows(k_pool)), bits(ref_k)) and torch.equal(bits(v_pool), bits(ref_v))
    out = kernel_attention(case, k_pool, v_pool)
    assert out.dtype == dtype and out.shape == case.q.shape
    assert max_relative_error(out, reference_attention(case, ref_k, ref_v)) < TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [16, 80, 256])
def test_attention_takes_any_head_dim_multiple_of_16(head_dim, dtype):
    query_lens, context_lens = BATCHES["mixed"]
    case = make_case(query_lens, context_lens, 6, 2, head_dim, 16, dtype, device="cpu", seed=head_dim)
    k_pool, v_pool = stored_pools(case, use_kernel=True)
    expected = reference_attention(case, as_rows(k_pool), v_pool)
    assert max_relative_error(kernel_attention(case, k_pool, v_pool), expected) < TOLERANCE[dtype]


@pytest.mark.parametrize(("window", "softcap"), [(0, 20.0), (16, 0.0), (50, 5.0), (1, 0.0)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sliding_window_and_softcap_match_plain_torch(window, softcap, dtype):
    case = make_case([1, 60, 1, 12], [65, 60, 200, 90], 6, 2, 64, 16, dtype, device="cpu", seed=3)
    k_pool, v_pool = stored_pools(case, use_kernel=True)
    out = kernel_attention(case, k_pool, v_pool, sliding_window=window, softcap=softcap)
    for i, context_len in enumerate(case.context_lens):
        start, end = case.cu_seqlens_q[i], case.cu_seqlens_q[i + 1]
        blocks = case.block_tables[i, : -(-context_len // 16)]
        k = as_rows(k_pool)[blocks].flatten(0, 1)[:context_len]
        v = v_pool[blocks].flatten(0, 1)[:context_len]
        expected = plain_attention(
            case.q[start:end], k, v, case.positions[start:end], case.scale, window, softcap
        )
        assert max_relative_error(out[start:end], expected) < TOLERANCE[dtype]


def sub_batch(case: AttentionCase, rows: list[tuple[int, int, int]]) -> tuple[torch.Tensor, ...]:
    """Call arguments for query rows given as (sequence, first token row, end token row) of `case`, each entry
    its own sequence in the new batch (sharing the pool and block table of the original)."""
    q = torch.cat([case.q[start:end] for _, start, end in rows])
    positions = torch.cat([case.positions[start:end] for _, start, end in rows])
    tables = torch.stack([case.block_tables[seq] for seq, _, _ in rows])
    lens = torch.tensor([0] + [end - start for _, start, end in rows]).cumsum(0)
    return q, tables, lens, positions


def run_rows(
    case: AttentionCase, k_pool: torch.Tensor, v_pool: torch.Tensor, rows: list[tuple[int, int, int]]
):
    q, tables, lens, positions = sub_batch(case, rows)
    return OPS.paged_attention(q, k_pool, v_pool, metadata(tables, lens, positions), case.scale)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_sequence_alone_equals_it_inside_a_batch(dtype):
    case = make_case([1, 30, 1, 12, 5], [65, 30, 129, 50, 300], 12, 4, 64, 16, dtype, device="cpu", seed=5)
    k_pool, v_pool = stored_pools(case, use_kernel=True)
    batch = kernel_attention(case, k_pool, v_pool)
    for seq in range(len(case.context_lens)):
        start, end = case.cu_seqlens_q[seq], case.cu_seqlens_q[seq + 1]
        assert torch.equal(run_rows(case, k_pool, v_pool, [(seq, start, end)]), batch[start:end])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_equals_chunks_equals_decode_rows(dtype):
    num_tokens = 600  # three splits of 256 keys
    case = make_case([num_tokens], [num_tokens], 9, 3, 64, 16, dtype, device="cpu", seed=7)
    k_pool, v_pool = stored_pools(case, use_kernel=True)
    prefill = kernel_attention(case, k_pool, v_pool)
    # The same positions as chunks (one call, each chunk a batch entry; then each chunk its own call) ...
    bounds = [0, 10, 37, 150, 299, 511, 599, num_tokens]
    chunks = [(0, a, b) for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
    assert torch.equal(run_rows(case, k_pool, v_pool, chunks), prefill)
    assert torch.equal(torch.cat([run_rows(case, k_pool, v_pool, [chunk]) for chunk in chunks]), prefill)
    # ... and as decode rows, one query each, in reverse order.
    decode_rows = [(0, t, t + 1) for t in reversed(range(num_tokens))]
    assert torch.equal(run_rows(case, k_pool, v_pool, decode_rows).flip(0), prefill)
    # A few decode rows at a time: with 2 threads each split of a row is an item of its own, merged after.
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        for t in (0, 255, 256, 300, 511, 512, num_tokens - 1):
            assert torch.equal(run_rows(case, k_pool, v_pool, [(0, t, t + 1)]), prefill[t : t + 1])
        pair = [(0, 599, 600), (0, 257, 258)]
        assert torch.equal(run_rows(case, k_pool, v_pool, pair), prefill[[599, 257]])
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("query_lens", "context_lens"),
    [
        ([1, 200, 1, 33], [65, 200, 129, 90]),
        # 6 decode rows: one item per split of 256 keys, row and KV head on 2 threads; one item per row
        # (all KV heads, its splits in turn) on 1 thread.
        ([1, 1, 1, 40, 1, 1, 1], [65, 530, 7, 40, 64, 800, 90]),
    ],
)
def test_thread_count_changes_nothing(dtype, query_lens, context_lens):
    case = make_case(query_lens, context_lens, 8, 2, 128, 32, dtype, device="cpu", seed=9)
    k_pool, v_pool = stored_pools(case, use_kernel=True)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = kernel_attention(case, k_pool, v_pool)
        torch.set_num_threads(2)
        two = kernel_attention(case, k_pool, v_pool)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)


def test_attention_rejects_a_block_table_outside_the_pool():
    case = make_case([1, 1], [20, 40], 4, 2, 64, 16, torch.float32, device="cpu")
    k_pool, v_pool = stored_pools(case, use_kernel=True)
    bad = case.block_tables.clone()
    bad[1, 1] = case.k_pool.shape[0]
    cu_seqlens_q = torch.tensor(case.cu_seqlens_q)
    with pytest.raises(RuntimeError, match="outside the pool"):
        OPS.paged_attention(case.q, k_pool, v_pool, metadata(bad, cu_seqlens_q, case.positions), case.scale)
    far = case.positions.clone()
    far[0] = 16 * case.block_tables.shape[1]
    with pytest.raises(RuntimeError, match="columns"):
        OPS.paged_attention(
            case.q, k_pool, v_pool, metadata(case.block_tables, cu_seqlens_q, far), case.scale
        )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_kv_skips_negative_slots_and_rejects_slots_outside(dtype):
    before_k = torch.randn(4, 16, 2, 64).to(dtype)
    before_v = torch.randn(4, 16, 2, 64).to(dtype)
    k_pool, v_pool = in_kernel_layout(before_k.clone()), before_v.clone()
    k, v = torch.randn(3, 2, 64).to(dtype), torch.randn(3, 2, 64).to(dtype)
    OPS.store_kv(k, v, k_pool, v_pool, torch.tensor([17, -1, 63]))
    after_k = as_rows(k_pool)
    assert torch.equal(after_k[1, 1], k[0]) and torch.equal(after_k[3, 15], k[2])
    assert torch.equal(v_pool[1, 1], v[0]) and torch.equal(v_pool[3, 15], v[2])
    after_k[1, 1], v_pool[1, 1] = before_k[1, 1], before_v[1, 1]
    after_k[3, 15], v_pool[3, 15] = before_k[3, 15], before_v[3, 15]
    assert torch.equal(after_k, before_k) and torch.equal(v_pool, before_v)
    with pytest.raises(RuntimeError, match="outside the pool"):
        OPS.store_kv(k, v, k_pool, v_pool, torch.tensor([0, 1, 64]))


def test_a_k_pool_in_pairs_is_checked_and_only_the_kernels_write_it():
    if len(OPS.k_pool_shape(4, 16, 2, 64, torch.bfloat16)) == 4:
        pytest.skip("this CPU has no AVX512-BF16: K pools stay in rows")
    k, v = torch.randn(1, 2, 64), torch.randn(1, 2, 64)
    with pytest.raises(RuntimeError, match="needs bfloat16"):
        OPS.store_kv(k, v, torch.zeros(4, 2, 32, 16, 2), torch.zeros(4, 16, 2, 64), torch.tensor([1]))
    k, v = k.bfloat16(), v.bfloat16()
    with pytest.raises(RuntimeError, match="in pairs must be"):
        OPS.store_kv(k, v, torch.zeros(4, 2, 16, 32, 2).bfloat16(), torch.zeros(4, 32, 2, 64).bfloat16(),
                     torch.tensor([1]))  # fmt: skip
    cache = KVCache(1, 4, 16, 2, 64, torch.bfloat16, torch.device("cpu"), ops=OPS)
    assert cache.k[0].shape == (4, 2, 32, 16, 2) and cache.v[0].shape == (4, 16, 2, 64)
    with pytest.raises(RuntimeError, match="kernels. layout"):
        cache.store_kv(0, k, v, torch.tensor([1]))


@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_add_rms_norm_matches_rmsnorm(dtype, with_residual):
    torch.manual_seed(0)
    hidden = 200  # not a multiple of 16: the tail takes the scalar path
    norm = RMSNorm(hidden, 1e-6)
    norm.weight.data = torch.randn(hidden).to(dtype)
    x = torch.randn(37, hidden).to(dtype)
    residual = torch.randn(37, hidden).to(dtype) if with_residual else None
    out, new_residual = OPS.fused_add_rms_norm(x, residual, norm.weight, 1e-6)
    if with_residual:
        expected, expected_residual = norm(x, residual)
        assert torch.equal(new_residual, expected_residual)
    else:
        expected = norm(x)
        assert new_residual is None
    assert out.dtype == dtype
    assert max_relative_error(out, expected) < (1e-6 if dtype == torch.float32 else 1e-2)


@pytest.mark.parametrize("attention_factor", [1.0, 1.25])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_is_bitwise_the_reference_in_place_on_qkv_views(dtype, attention_factor):
    torch.manual_seed(0)
    num_heads, num_kv_heads, head_dim = 6, 2, 64
    rotary = RotaryEmbedding(head_dim, 10000.0, None)
    rotary.attention_factor = attention_factor  # what YaRN / LongRoPE scaling sets
    qkv = torch.randn(50, (num_heads + 2 * num_kv_heads) * head_dim).to(dtype)
    positions = torch.randint(0, 4000, (50,))
    q = qkv[:, : num_heads * head_dim].view(50, num_heads, head_dim)
    k = qkv[:, num_heads * head_dim : (num_heads + num_kv_heads) * head_dim].view(50, num_kv_heads, head_dim)
    expected_q, expected_k = rotary(positions, q.clone(), k.clone())
    v_before = qkv[:, (num_heads + num_kv_heads) * head_dim :].clone()
    OPS.rotary_embedding(q, k, *rotary.cos_sin(positions, dtype))
    assert torch.equal(q, expected_q) and torch.equal(k, expected_k)
    assert torch.equal(qkv[:, (num_heads + num_kv_heads) * head_dim :], v_before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_and_mul_matches_torch(dtype):
    torch.manual_seed(0)
    x = (torch.randn(33, 2 * 200) * 4).to(dtype)
    gate, up = x.chunk(2, dim=-1)
    expected = torch.nn.functional.silu(gate) * up
    out = OPS.silu_and_mul(x)
    assert out.dtype == dtype and out.shape == expected.shape
    assert max_relative_error(out, expected) < (1e-6 if dtype == torch.float32 else 1e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_and_mul_vector_chunks_equal_the_tail(dtype):
    """Whole 16-lane chunks run in registers and a ragged tail through a buffer: the same bits either way."""
    torch.manual_seed(1)
    x = (torch.randn(9, 2 * 32) * 4).to(dtype)
    gate, up = x.chunk(2, dim=-1)
    in_chunks = OPS.silu_and_mul(x)  # intermediate 32: two whole chunks
    in_tail = OPS.silu_and_mul(torch.cat([gate[:, :15], up[:, :15]], dim=-1))  # intermediate 15: all tail
    assert torch.equal(in_chunks[:, :15], in_tail)


def smaps_entry(address: int) -> str:
    """The /proc/self/smaps block of the mapping that holds `address`."""
    entry: list[str] | None = None
    for line in Path("/proc/self/smaps").read_text().splitlines():
        header = re.match(r"([0-9a-f]+)-([0-9a-f]+) ", line)
        if header:
            if entry is not None:
                break
            if int(header[1], 16) <= address < int(header[2], 16):
                entry = []
        elif entry is not None:
            entry.append(line)
    assert entry is not None, f"no mapping holds {address:#x}"
    return "\n".join(entry)


def test_empty_huge_pages_is_zeroed_writable_and_asks_for_huge_pages():
    t = cpu.empty_huge_pages((1024, 1024), torch.bfloat16)
    assert t.shape == (1024, 1024) and t.dtype == torch.bfloat16 and not t.any()
    t.fill_(1.5)
    assert bool((t == 1.5).all())
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if not thp.is_file() or "[never]" in thp.read_text():
        pytest.skip("this kernel has no transparent huge pages to ask for")
    assert re.search(r"THPeligible:\s+1", smaps_entry(t.data_ptr()))


@pytest.mark.parametrize("n", [1, 7, 16, 17, 49_153])
def test_argmax_rows_is_torch_max_index_with_ties_nan_and_infinities(n: int) -> None:
    torch.manual_seed(n)
    x = torch.randn(8, n) * 5
    x[1] = float("-inf")  # every token masked: torch picks the first
    x[2, n // 2 :] = float("-inf")
    x[3, n - 1] = float("nan")  # a NaN is the maximum, wherever the largest number is
    x[4, [n // 3, n - 1]] = 100.0  # a tie: the first wins
    x[5, [0, n - 1]] = float("nan")
    x[6, n - 1] = float("inf")
    assert torch.equal(OPS.argmax_rows(x), x.max(dim=-1).indices)


@pytest.mark.parametrize("n", [1, 7, 16, 17, 49_153])
def test_softmax_stats_give_log_softmax(n: int) -> None:
    torch.manual_seed(n)
    x = torch.randn(6, n) * 8
    x[1, (n + 1) // 2 :] = float("-inf")  # masked tokens add nothing
    x[2] += 1000.0  # large logits: the max is taken out before exp
    row_max, log_sum = OPS.softmax_stats(x)
    assert torch.equal(row_max, x.amax(dim=-1))
    torch.testing.assert_close((x - row_max[:, None]) - log_sum[:, None], x.log_softmax(dim=-1))


def test_row_reductions_do_not_depend_on_the_other_rows_or_threads() -> None:
    torch.manual_seed(0)
    x = torch.randn(16, 4096)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)  # the rows split over 2 threads, then each alone on 1
        argmax = OPS.argmax_rows(x)
        row_max, log_sum = OPS.softmax_stats(x)
        torch.set_num_threads(1)
        for i in range(16):
            alone_max, alone_log_sum = OPS.softmax_stats(x[i : i + 1])
            assert OPS.argmax_rows(x[i : i + 1]).item() == argmax[i].item()
            assert torch.equal(bits(alone_max), bits(row_max[i : i + 1]))
            assert torch.equal(bits(alone_log_sum), bits(log_sum[i : i + 1]))
    finally:
        torch.set_num_threads(threads)
