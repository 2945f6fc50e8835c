"""Rill's Triton kernels outside attention (rill/kernels/triton_ops.py, through rill.kernels.gpu.GpuOps)
against the shard's torch references.

Without a GPU they run under Triton's interpreter on CPU tensors: tests/shard/conftest.py sets
`TRITON_INTERPRET=1` when no CUDA device is present, before anything imports the kernels (the `@triton.jit`
decorators read it at import), so CI executes the kernels' own code. With a GPU the same tests run compiled,
on it. Tolerances: bitwise for store_kv, rotary, the residual sum and argmax (same roundings at the same
points, or no arithmetic at all); RMSNorm's output 1e-6 relative in float32 (only the order of the sum of
squares differs); in 16-bit dtypes every element within 2 ulp of the reference's and 99% its bits (the same
rounding points, from float32 values that differ in their last bits); SiLU-and-mul the same (another exp);
softmax statistics to float32 `assert_close`. Each kernel's result for a row is checked to be the same bits
alone and in a batch.
"""

from __future__ import annotations

import os

import pytest
import torch
from rill.kernels import gpu, triton_ops
from rill.kernels.ops import KernelOps
from rill.shard.batch import ForwardRequest
from rill.shard.layers.activation import SiluAndMul
from rill.shard.layers.backend import install_ops
from rill.shard.layers.norm import RMSNorm
from rill.shard.layers.rotary import RotaryEmbedding
from rill.shard.sampling import first_argmax, softmax_stats

from bench.kernel_cases import max_relative_error

from .conftest import chunk, make_runner

OPS = gpu.GpuOps()
DEVICE = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
FLOAT32_TOLERANCE = 1e-6  # relative


def bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bit patterns, any NaN as one pattern (a NaN's payload is nobody's contract), so NaN
    compares equal to NaN and -0.0 differs from 0.0."""
    t = torch.where(t.isnan(), torch.full_like(t, float("nan")), t)
    return t.view({4: torch.int32, 2: torch.int16, 8: torch.int64}[t.element_size()])


def assert_rounded_like_the_reference(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """float32: within FLOAT32_TOLERANCE. 16-bit: the kernel rounds where the reference does, from float32
    values that differ in their last bits at most (another exp, another order of a sum), so an element is off
    by at most 2 ulp (1 ulp of an intermediate, times the weight) and at least 99% are the reference's bits; a
    rounding point moved breaks that long before it breaks a 1e-2 tolerance."""
    assert actual.dtype == expected.dtype
    if actual.dtype == torch.float32:
        assert max_relative_error(actual, expected) <= FLOAT32_TOLERANCE
        return
    distance = (bits(actual).int() - bits(expected).int()).abs()
    assert distance.max().item() <= 2
    assert (distance == 0).float().mean().item() >= 0.99, (distance == 0).float().mean().item()


def randn(*shape: int, dtype: torch.dtype = torch.float32, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape) * scale).to(dtype).to(DEVICE)


def test_the_kernels_run_interpreted_where_there_is_no_gpu():
    if DEVICE == "cpu":
        assert type(triton_ops._store_kv_kernel).__name__ == "InterpretedFunction", (
            "rill.kernels.triton_ops was imported before TRITON_INTERPRET=1 was set (tests/shard/conftest.py)"
        )
        assert OPS.unavailable_reason() == "no CUDA device for Rill's Triton kernels"
    else:
        assert OPS.unavailable_reason() is None


def test_gpu_ops_provide_every_op_but_linear():
    assert OPS.name == "cuda" and OPS.captures_cuda_graphs
    assert OPS.load() is triton_ops
    for op in ("silu_and_mul", "argmax_rows", "softmax_stats"):
        assert OPS.provides(op)
    assert not OPS.provides("linear") and not OPS.provides("pack_linear")
    assert OPS.k_pool_shape(5, 16, 2, 64, torch.bfloat16) == (5, 16, 2, 64)
    assert OPS.attention_unsupported(128, 32, 8, 4096, 50.0) is None
    assert OPS.attention_unsupported(256, 8, 1, 0, 0.0) is None
    assert "multiple of 16" in OPS.attention_unsupported(80 + 8, 4, 4, 0, 0.0)
    assert "[16, 256]" in OPS.attention_unsupported(320, 4, 4, 0, 0.0)


# --- store_kv ---


@pytest.mark.parametrize(
    ("dtype", "pool_dtype"),
    [(dtype, dtype) for dtype in DTYPES] + [(torch.float32, torch.bfloat16), (torch.float32, torch.float16)],
)
def test_store_kv_is_bitwise_index_copy_and_skips_slots_outside(dtype, pool_dtype):
    torch.manual_seed(0)
    num_tokens, num_kv_heads, head_dim = 7, 3, 40  # head_dim and heads not powers of two
    qkv = randn(num_tokens, (4 + 2 * num_kv_heads) * head_dim, dtype=dtype, scale=3.0)
    # k, v: views of the fused projection's output (token stride = its width)
    k = qkv[:, 4 * head_dim : (4 + num_kv_heads) * head_dim].view(num_tokens, num_kv_heads, head_dim)
    v = qkv[:, (4 + num_kv_heads) * head_dim :].view(num_tokens, num_kv_heads, head_dim)
    shape = (4, 8, num_kv_heads, head_dim)  # [num_blocks, block_size, ...]: 32 slots
    k_pool = torch.full(shape, float("nan"), dtype=pool_dtype, device=DEVICE)
    v_pool = torch.full(shape, float("nan"), dtype=pool_dtype, device=DEVICE)
    slots = torch.tensor([3, -1, 0, 31, 32, 17, 1000], device=DEVICE)  # -1: none; 32, 1000: past the pool
    OPS.store_kv(k, v, k_pool, v_pool, slots)
    kept = torch.tensor([0, 2, 3, 5])
    for pool, new in ((k_pool, k), (v_pool, v)):
        expected = torch.full((32, num_kv_heads, head_dim), float("nan"), dtype=pool_dtype, device=DEVICE)
        expected.index_copy_(0, slots[kept], new[kept].to(pool_dtype))
        assert torch.equal(bits(pool.view(32, num_kv_heads, head_dim)), bits(expected))


# --- fused add + RMSNorm ---


@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_add_rms_norm_matches_rmsnorm(dtype, with_residual):
    torch.manual_seed(0)
    hidden = 200  # not a power of two: masked lanes
    norm = RMSNorm(hidden, 1e-6)
    norm.weight.data = randn(hidden, dtype=dtype)
    x = randn(9, hidden, dtype=dtype, scale=4.0)
    residual = randn(9, hidden, dtype=dtype) if with_residual else None
    x[4, 7] = float("nan")  # a poisoned row stays its own
    out, new_residual = OPS.fused_add_rms_norm(x, residual, norm.weight, 1e-6)
    norm.use_ops(None)
    if with_residual:
        expected, expected_residual = norm(x, residual)
        assert torch.equal(bits(new_residual), bits(expected_residual))
    else:
        expected = norm(x)
        assert new_residual is None
    assert out.dtype == dtype and out.shape == x.shape
    assert out[4].isnan().all() and not out[[0, 1, 2, 3, 5, 6, 7, 8]].isnan().any()
    rows = [0, 1, 2, 3, 5, 6, 7, 8]
    assert_rounded_like_the_reference(out[rows], expected[rows])
    # The layer's path: RMSNorm with ops calls the kernel, with the same bits.
    norm.use_ops(OPS)
    through_layer = norm(x, residual)
    assert torch.equal(bits(through_layer[0] if with_residual else through_layer), bits(out))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_of_a_row_is_the_same_alone_and_in_a_batch(dtype):
    torch.manual_seed(1)
    weight = randn(96, dtype=dtype)
    x, residual = randn(6, 96, dtype=dtype), randn(6, 96, dtype=dtype)
    out, new_residual = OPS.fused_add_rms_norm(x, residual, weight, 1e-5)
    for row in (0, 5):
        alone, alone_residual = OPS.fused_add_rms_norm(
            x[row : row + 1], residual[row : row + 1], weight, 1e-5
        )
        assert torch.equal(bits(alone), bits(out[row : row + 1]))
        assert torch.equal(bits(alone_residual), bits(new_residual[row : row + 1]))


# --- rotary ---


@pytest.mark.parametrize(("head_dim", "num_heads", "num_kv_heads"), [(64, 6, 2), (80, 3, 1), (256, 40, 8)])
@pytest.mark.parametrize("attention_factor", [1.0, 1.25])
@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_is_bitwise_the_reference_in_place_on_qkv_views(
    dtype, attention_factor, head_dim, num_heads, num_kv_heads
):
    torch.manual_seed(0)
    num_tokens = 5
    rotary = RotaryEmbedding(head_dim, 10000.0, None)
    rotary.attention_factor = attention_factor  # what YaRN / LongRoPE scaling sets
    width = (num_heads + 2 * num_kv_heads) * head_dim
    qkv = randn(num_tokens, width, dtype=dtype, scale=2.0)
    positions = torch.randint(0, 40000, (num_tokens,)).to(DEVICE)
    q = qkv[:, : num_heads * head_dim].view(num_tokens, num_heads, head_dim)
    k = qkv[:, num_heads * head_dim : (num_heads + num_kv_heads) * head_dim].view(
        num_tokens, num_kv_heads, head_dim
    )
    expected_q, expected_k = rotary(positions, q.clone(), k.clone())
    v_before = qkv[:, (num_heads + num_kv_heads) * head_dim :].clone()
    rotary.use_ops(OPS)
    assert rotary(positions, q, k) == (q, k)  # in place
    assert torch.equal(q, expected_q) and torch.equal(k, expected_k)
    assert torch.equal(qkv[:, (num_heads + num_kv_heads) * head_dim :], v_before)


def test_rotary_of_a_token_is_the_same_alone_and_in_a_batch():
    torch.manual_seed(2)
    rotary = RotaryEmbedding(64, 500000.0, None)
    q, k = randn(6, 4, 64, dtype=torch.bfloat16), randn(6, 2, 64, dtype=torch.bfloat16)
    positions = torch.tensor([0, 5, 99, 1000, 7, 31000]).to(DEVICE)
    batch_q, batch_k = q.clone(), k.clone()
    OPS.rotary_embedding(batch_q, batch_k, *rotary.cos_sin(positions, torch.bfloat16))
    for token in (0, 3, 5):
        alone_q, alone_k = q[token : token + 1].clone(), k[token : token + 1].clone()
        OPS.rotary_embedding(alone_q, alone_k, *rotary.cos_sin(positions[token : token + 1], torch.bfloat16))
        assert torch.equal(alone_q, batch_q[token : token + 1]) and torch.equal(
            alone_k, batch_k[token : token + 1]
        )


# --- SiLU-and-mul ---


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_matches_torch(dtype):
    torch.manual_seed(0)
    x = randn(7, 2, 2 * 200, dtype=dtype, scale=4.0)  # leading dims kept; intermediate not a power of two
    gate, up = x.chunk(2, dim=-1)
    expected = torch.nn.functional.silu(gate) * up
    layer = SiluAndMul()
    layer.use_ops(OPS)
    out = layer(x)
    assert out.dtype == dtype and out.shape == expected.shape
    assert_rounded_like_the_reference(out, expected)
    alone = OPS.silu_and_mul(x[3:4])
    assert torch.equal(bits(alone), bits(out[3:4]))


# --- the sampler's row reductions ---

ROW_LENGTHS = [1, 7, triton_ops.ROW_CHUNK, triton_ops.ROW_CHUNK + 1, 3000]


@pytest.mark.parametrize("n", ROW_LENGTHS)
def test_argmax_rows_is_torch_max_index_with_ties_nan_and_infinities(n: int) -> None:
    torch.manual_seed(n)
    x = torch.randn(10, n) * 5
    x[1] = float("-inf")  # every token masked: torch picks the first
    x[2, n // 2 :] = float("-inf")
    x[3, n - 1] = float("nan")  # a NaN is the maximum, wherever the largest number is
    x[4, [n // 3, n - 1]] = 100.0  # a tie, in two chunks when n > ROW_CHUNK: the first wins
    x[5, [0, n - 1]] = float("nan")
    x[6, n - 1] = float("inf")
    x[7, [n - 1, n // 2]] = 200.0  # a tie, the later one written first
    x[8, 0] = 300.0
    x[8, n - 1] = float("nan")  # the maximum in the first chunk, a NaN in the last
    x[9] = 1.0  # all equal
    x = x.to(DEVICE)
    expected = x.max(dim=-1).indices
    assert torch.equal(OPS.argmax_rows(x), expected)
    assert torch.equal(first_argmax(x, OPS), expected)


@pytest.mark.parametrize("n", ROW_LENGTHS)
def test_softmax_stats_give_log_softmax(n: int) -> None:
    torch.manual_seed(n)
    x = torch.randn(6, n) * 8
    x[1, (n + 1) // 2 :] = float("-inf")  # masked tokens add nothing
    x[2] += 1000.0  # large logits: the max is taken out before exp
    x = x.to(DEVICE)
    row_max, log_sum = softmax_stats(x, OPS)
    assert torch.equal(row_max, x.amax(dim=-1))
    torch.testing.assert_close((x - row_max[:, None]) - log_sum[:, None], x.log_softmax(dim=-1))


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # numpy, on inf - inf
def test_softmax_stats_of_nan_and_infinite_rows_are_the_references():
    x = torch.randn(4, 1500)
    x[0, 1200] = float("nan")
    x[1] = float("-inf")
    x[2, 3] = float("inf")
    x = x.to(DEVICE)
    row_max, log_sum = OPS.softmax_stats(x)
    expected_max, expected_log_sum = softmax_stats(x, None)
    assert row_max[0].isnan() and expected_max[0].isnan()  # a NaN row: NaN statistics
    assert torch.equal(row_max[1:], expected_max[1:])  # -inf, +inf, a plain row
    assert log_sum[:3].isnan().all() and expected_log_sum[:3].isnan().all()
    torch.testing.assert_close(log_sum[3], expected_log_sum[3])


def test_row_reductions_do_not_depend_on_the_other_rows() -> None:
    torch.manual_seed(0)
    x = randn(8, 2100, scale=3.0)
    argmax = OPS.argmax_rows(x)
    row_max, log_sum = OPS.softmax_stats(x)
    for i in (0, 4, 7):
        alone_max, alone_log_sum = OPS.softmax_stats(x[i : i + 1])
        assert OPS.argmax_rows(x[i : i + 1]).item() == argmax[i].item()
        assert torch.equal(bits(alone_max), bits(row_max[i : i + 1]))
        assert torch.equal(bits(alone_log_sum), bits(log_sum[i : i + 1]))


def test_gpu_ops_is_a_complete_kernel_ops() -> None:
    assert not getattr(gpu.GpuOps, "__abstractmethods__", None)
    assert issubclass(gpu.GpuOps, KernelOps)


# --- a whole forward ---


@pytest.mark.skipif(DEVICE != "cpu", reason="the tiny model runs on the CPU (interpreted kernels)")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_tiny_model_through_the_triton_kernels_equals_the_torch_path(llama_dir, dtype, tensor_core_dots):
    """Prefill of two prompts, then a decode step of both, through GpuOps' kernels (interpreted), against the
    same model on the torch references: logits within float32 rounding (bfloat16: 5e-2 of their scale, as the
    attention kernel rounds its probabilities to bfloat16 before the product with V and the reference does
    not; measured 2.1e-2 through the two layers), the same tokens."""
    reference = make_runner(llama_dir, attention_backend="torch", dtype=dtype)
    kernels = make_runner(llama_dir, attention_backend="torch", dtype=dtype)
    ops = gpu.GpuOps()
    kernels.ops = ops
    install_ops(kernels.model, ops)
    steps = [
        [chunk(1, list(range(5, 15)), 0, 1), chunk(2, [7, 3, 9, 200, 11, 4, 60], 0, 10)],
        [chunk(1, [42], 10, 1), chunk(2, [17], 7, 10)],
    ]
    for step in steps:
        _, expected, _ = reference.forward_logits(ForwardRequest(sequences=step))
        _, actual, _ = kernels.forward_logits(ForwardRequest(sequences=step))
        assert max_relative_error(actual, expected) <= (1e-5 if dtype == "float32" else 5e-2)
        assert torch.equal(ops.argmax_rows(actual), expected.max(dim=-1).indices)
    blocks = [1, 2, 3, 10, 11]  # the K/V each wrote
    for pools, reference_pools in (
        (kernels.kv_cache.k, reference.kv_cache.k),
        (kernels.kv_cache.v, reference.kv_cache.v),
    ):
        for pool, reference_pool in zip(pools, reference_pools, strict=True):
            error = max_relative_error(pool[blocks], reference_pool[blocks])
            assert error <= (1e-5 if dtype == "float32" else 2e-2)
