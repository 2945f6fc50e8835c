"""Rill's Triton paged attention (rill/kernels/triton_attention.py), on the CPU under Triton's interpreter
where there is no GPU (tests/shard/conftest.py sets TRITON_INTERPRET=1 before the kernels are imported, and
`tensor_core_dots` makes the interpreter's `tl.dot` compute as a tensor core does). The kernels' source is the
one compiled for sm_80 / sm_90 by .ci/compile_triton.py.

Cases come from bench/kernel_cases.py (blocks in random order, NaN in the null block and in every slot past
a sequence's context). SPLIT_KEYS is lowered to 128 (two 64-key tiles) so small contexts cross splits, and
tiles within a split.
Tolerances: float32 1e-5 relative (other summation order than torch's), bfloat16 / float16 1e-2 (the
kernel rounds the probabilities to the pools' dtype before the dot with V, the reference does not).
Batch invariance is checked bitwise: alone vs in a batch, prefill vs chunks vs decode rows (the contract
at the top of the kernel's file says why these hold).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from rill.kernels import triton_attention
from rill.kernels.ops import AttentionMetadata
from rill.shard.layers.attention import tiled_causal_attention

from bench.kernel_cases import AttentionCase, make_case, max_relative_error, plain_attention

from .conftest import IS_INTERPRETED

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 1e-2}
BATCHES = {
    "decode": ([1, 1, 1, 1], [17, 64, 150, 33]),
    "prefill": ([40, 7, 70], [40, 7, 70]),
    "mixed": ([1, 30, 1, 12], [65, 30, 129, 50]),
}


@pytest.fixture(autouse=True)
def small_splits(monkeypatch: pytest.MonkeyPatch, tensor_core_dots: None) -> None:
    if IS_INTERPRETED:
        assert type(triton_attention._paged_attention_tiles).__name__ == "InterpretedFunction"
    monkeypatch.setattr(triton_attention, "SPLIT_KEYS", 128)


def gathered(case: AttentionCase, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequence `seq`'s keys and values from position 0, through its block table."""
    block_size, context_len = case.k_pool.shape[1], case.context_lens[seq]
    blocks = case.block_tables[seq, : -(-context_len // block_size)]
    k = case.k_pool[blocks].flatten(0, 1)[:context_len]
    v = case.v_pool[blocks].flatten(0, 1)[:context_len]
    return k, v


def reference(case: AttentionCase) -> torch.Tensor:
    """The shard's reference, `tiled_causal_attention`, per sequence."""
    out = torch.empty_like(case.q)
    for i in range(len(case.context_lens)):
        start, end = case.cu_seqlens_q[i], case.cu_seqlens_q[i + 1]
        k, v = gathered(case, i)
        out[start:end] = tiled_causal_attention(
            case.q[start:end], k, v, case.positions[start:end], case.scale
        )
    return out


def sequence_plain_attention(case: AttentionCase, seq: int, window: int, softcap: float) -> torch.Tensor:
    """`plain_attention` (float64, spelled out) of sequence `seq` of the case."""
    start, end = case.cu_seqlens_q[seq], case.cu_seqlens_q[seq + 1]
    k, v = gathered(case, seq)
    return plain_attention(case.q[start:end], k, v, case.positions[start:end], case.scale, window, softcap)


def attend(case: AttentionCase, meta: AttentionMetadata | None = None, **options: float) -> torch.Tensor:
    return triton_attention.paged_attention(
        case.q, case.k_pool, case.v_pool, meta or case.metadata(), case.scale, **options
    )


def sub_batch(
    case: AttentionCase, rows: list[tuple[int, int, int]]
) -> tuple[torch.Tensor, AttentionMetadata]:
    """q and metadata for query rows given as (sequence, first token row, end token row) of `case`, each entry
    its own sequence in the new batch (sharing the pools and block table of the original)."""
    q = torch.cat([case.q[start:end] for _, start, end in rows])
    positions = torch.cat([case.positions[start:end] for _, start, end in rows])
    tables = torch.stack([case.block_tables[seq] for seq, _, _ in rows])
    cu = [0]
    for _, start, end in rows:
        cu.append(cu[-1] + end - start)
    context_lens = [int(positions[end - 1]) + 1 for end in cu[1:]]
    return q, AttentionMetadata.build(cu, context_lens, tables, torch.empty(0, dtype=torch.int64), positions)


def run_rows(case: AttentionCase, rows: list[tuple[int, int, int]], **options: float) -> torch.Tensor:
    q, meta = sub_batch(case, rows)
    return triton_attention.paged_attention(q, case.k_pool, case.v_pool, meta, case.scale, **options)


# (batch, block_size, head_dim, group, dtype): every block size, head dim 64 / 128, group 1 / 3 / 4 / 8 and
# dtype meets every batch kind; the full product would take the interpreter minutes.
MATCH_CASES = [
    ("decode", 8, 64, 1, torch.float32),
    ("decode", 16, 128, 4, torch.bfloat16),
    ("decode", 32, 64, 8, torch.float16),
    ("decode", 16, 64, 3, torch.float32),
    ("prefill", 16, 64, 4, torch.float32),
    ("prefill", 32, 128, 1, torch.bfloat16),
    ("prefill", 8, 64, 3, torch.bfloat16),
    ("prefill", 16, 128, 8, torch.float16),
    ("mixed", 32, 64, 3, torch.float32),
    ("mixed", 8, 128, 8, torch.float32),
    ("mixed", 16, 64, 1, torch.bfloat16),
    ("mixed", 8, 64, 4, torch.bfloat16),
]


@pytest.mark.parametrize(("batch", "block_size", "head_dim", "group", "dtype"), MATCH_CASES)
def test_attention_matches_the_reference(batch, block_size, head_dim, group, dtype):
    query_lens, context_lens = BATCHES[batch]
    case = make_case(
        query_lens, context_lens, 2 * group, 2, head_dim, block_size, dtype, device="cpu", seed=group
    )
    out = attend(case)
    assert out.dtype == dtype and out.shape == case.q.shape
    assert max_relative_error(out, reference(case)) < TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [80, 96, 256])
def test_attention_takes_head_dims_that_are_not_powers_of_two_and_256(head_dim, dtype):
    case = make_case([1, 20, 1], [65, 20, 40], 6, 2, head_dim, 16, dtype, device="cpu", seed=head_dim)
    assert max_relative_error(attend(case), reference(case)) < TOLERANCE[dtype]


def release_window_blocks(case: AttentionCase, window: int) -> AttentionMetadata:
    """The case's metadata with every block that all of a sequence's queries' windows have left pointing at
    the null block (NaN), as the router does once it releases them."""
    tables = case.block_tables.clone()
    block_size = case.k_pool.shape[1]
    for seq in range(len(case.context_lens)):
        first_visible = int(case.positions[case.cu_seqlens_q[seq]]) - window + 1
        tables[seq, : max(first_visible, 0) // block_size] = 0
    return dataclasses.replace(case.metadata(), block_tables=tables)


@pytest.mark.parametrize(("window", "softcap"), [(0, 20.0), (16, 0.0), (50, 5.0), (1, 0.0)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sliding_window_and_softcap_match_plain_torch_with_released_blocks(window, softcap, dtype):
    case = make_case([1, 60, 1, 12], [65, 60, 150, 90], 6, 2, 64, 16, dtype, device="cpu", seed=3)
    meta = release_window_blocks(case, window) if window > 0 else case.metadata()
    if window in (16, 50):
        assert bool((meta.block_tables == 0).sum() > (case.block_tables == 0).sum())
    out = attend(case, meta, sliding_window=window, softcap=softcap)
    for seq in range(len(case.context_lens)):
        start, end = case.cu_seqlens_q[seq], case.cu_seqlens_q[seq + 1]
        expected = sequence_plain_attention(case, seq, window, softcap)
        assert max_relative_error(out[start:end], expected) < TOLERANCE[dtype]


def test_decode_crosses_the_default_split_size(monkeypatch):
    monkeypatch.setattr(triton_attention, "SPLIT_KEYS", 512)
    case = make_case([1, 1], [600, 1100], 4, 2, 64, 32, torch.float32, device="cpu", seed=11)
    assert max_relative_error(attend(case), reference(case)) < TOLERANCE[torch.float32]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_sequence_alone_equals_it_inside_a_batch(dtype):
    case = make_case([1, 30, 1, 12, 5], [65, 30, 140, 50, 150], 6, 2, 64, 16, dtype, device="cpu", seed=5)
    batch = attend(case)
    for seq in range(len(case.context_lens)):
        start, end = case.cu_seqlens_q[seq], case.cu_seqlens_q[seq + 1]
        assert torch.equal(run_rows(case, [(seq, start, end)]), batch[start:end])
    # Decode rows alone, in a decode batch, and under a larger (CUDA graph capture) context bound.
    decode = [(0, 0, 1), (2, 31, 32)]
    together = run_rows(case, decode)
    assert torch.equal(together, torch.cat([batch[0:1], batch[31:32]]))
    q, meta = sub_batch(case, decode)
    bounded = dataclasses.replace(meta, max_context_len=700)
    assert torch.equal(
        triton_attention.paged_attention(q, case.k_pool, case.v_pool, bounded, case.scale), together
    )


@pytest.mark.parametrize(
    ("dtype", "window", "softcap"),
    [(torch.float32, 0, 0.0), (torch.bfloat16, 0, 0.0), (torch.float32, 37, 10.0)],
)
def test_prefill_equals_chunks_equals_decode_rows(dtype, window, softcap):
    num_tokens = 140
    case = make_case([num_tokens], [num_tokens], 3, 1, 64, 16, dtype, device="cpu", seed=7)
    options = dict(sliding_window=window, softcap=softcap)
    prefill = attend(case, **options)
    assert max_relative_error(prefill, sequence_plain_attention(case, 0, window, softcap)) < TOLERANCE[dtype]
    # The same positions as chunks (one call, each chunk a batch entry; then each chunk its own call) ...
    bounds = [0, 10, 37, 100, 139, num_tokens]
    chunks = [(0, a, b) for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
    assert torch.equal(run_rows(case, chunks, **options), prefill)
    assert torch.equal(torch.cat([run_rows(case, [chunk], **options) for chunk in chunks]), prefill)
    # ... and as decode rows (split kernel + merge kernel), one query each, in reverse order: positions at
    # the edges of tiles (64) and splits (128), in one decode batch.
    positions = [139, 129, 128, 127, 100, 65, 64, 63, 37, 36, 1, 0]
    decode_rows = run_rows(case, [(0, t, t + 1) for t in positions], **options)
    assert torch.equal(decode_rows, prefill[positions])


def test_unsupported_shapes_say_why():
    assert triton_attention.unsupported(128, 32, 8, torch.bfloat16) is None
    assert "multiple of 16" in (triton_attention.unsupported(72, 8, 2, torch.float32) or "")
    assert "multiple of 16" in (triton_attention.unsupported(512, 8, 2, torch.float32) or "")
    assert "group" in (triton_attention.unsupported(64, 6, 4, torch.float32) or "")
    assert "float64" in (triton_attention.unsupported(64, 8, 2, torch.float64) or "")
    case = make_case([1], [5], 2, 1, 72, 8, torch.float32, device="cpu")
    with pytest.raises(ValueError, match="multiple of 16"):
        attend(case)
