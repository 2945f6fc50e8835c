"""`CpuOps.linear`, the CPU kernels' matmul (float32; bfloat16 on CPUs with AVX512-BF16): against a
float64 product, its documented arithmetic exactly, and batch-invariant bitwise.

Row r of x @ w^T must come out with the same bits whatever else is in x (a decode batch of 1, 16 or 64 rows, a
600-token prefill, a chunk of it) and whatever the thread count: the float32 invariance of the whole model
rests on it (MKL's own GEMM changes its reduction with the row count and, on 2 threads, at 64+ rows too).
"""

from __future__ import annotations

import pytest
import torch
from rill.kernels import cpu as cpu_kernels

OPS = cpu_kernels.CpuOps()

# (in, out): the default model's shapes (qkv, o, gate/up, down); odd ones with output tails, an odd input.
SHAPES = [(576, 960), (576, 576), (576, 3072), (1536, 576), (100, 33), (48, 7), (37, 40)]
needs_bf16 = pytest.mark.skipif(
    torch.bfloat16 not in cpu_kernels.linear_dtypes(),
    reason="this CPU has no AVX512-BF16: bfloat16 models use torch's matmul",
)
DTYPES = [torch.float32, pytest.param(torch.bfloat16, marks=needs_bf16)]
# Relative to the largest output: float32 sums in float32; bfloat16 also rounds its inputs' products' sum to
# bfloat16 once (8 significant bits) at the end.
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2**-8}


@pytest.fixture(autouse=True)
def restore_threads():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def random_weight(
    in_features: int, out_features: int, seed: int, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Generator]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(out_features, in_features, generator=generator).to(dtype), generator


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("in_features", "out_features"), SHAPES)
def test_matches_a_float64_product(in_features, out_features, dtype):
    w, generator = random_weight(in_features, out_features, in_features + out_features, dtype)
    x = torch.randn(37, in_features, generator=generator).to(dtype)
    expected = x.double() @ w.double().T
    y = OPS.linear(x, OPS.pack_linear(w), out_features)
    assert y.dtype == dtype and y.shape == (37, out_features)
    error = ((y.double() - expected).abs().max() / expected.abs().max()).item()
    assert error <= TOLERANCE[dtype]


def test_each_output_is_one_ascending_fma_chain():
    """The documented arithmetic: y[r, n] = fma(x[r, K-1], w[n, K-1], ... fma(x[r, 0], w[n, 0], 0))."""
    w, generator = random_weight(40, 35, 3)
    x = torch.randn(5, 40, generator=generator)
    expected = torch.zeros(5, 35, dtype=torch.float64)
    for step in range(40):  # float64 product + sum of two float32 values, rounded once: a float32 FMA
        expected = (expected + x[:, step, None].double() * w[None, :, step].double()).float().double()
    y = OPS.linear(x, OPS.pack_linear(w), 35)
    assert torch.equal(y, expected.float())


@needs_bf16
def test_bfloat16_is_one_pair_product_chain():
    """The documented arithmetic in bfloat16: per pair of inputs, vdpbf16ps as Intel's SDM defines it (the
    second product added to the float32 sum, then the first; bfloat16 products are exact in float32), rounded
    to bfloat16 at the end; an odd input count ends with a pair whose second half is zero."""
    w, generator = random_weight(41, 35, 5, torch.bfloat16)
    x = torch.randn(5, 41, generator=generator).bfloat16()
    x64, w64 = (torch.nn.functional.pad(t.double(), (0, 1)) for t in (x, w))  # a zero 42nd input
    expected = torch.zeros(5, 35, dtype=torch.float64)
    for step in range(0, 42, 2):
        second = x64[:, step + 1, None] * w64[None, :, step + 1]
        first = x64[:, step, None] * w64[None, :, step]
        expected = ((expected + second).float().double() + first).float().double()
    y = OPS.linear(x, OPS.pack_linear(w), 35)
    assert torch.equal(y, expected.float().bfloat16())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("in_features", "out_features"), SHAPES)
def test_a_row_does_not_depend_on_the_batch_or_the_threads(in_features, out_features, dtype):
    w, generator = random_weight(in_features, out_features, 7, dtype)
    packed = OPS.pack_linear(w)
    x = torch.randn(600, in_features, generator=generator).to(dtype)
    torch.set_num_threads(2)
    full = OPS.linear(x, packed, out_features)
    for num_rows in (1, 2, 3, 5, 12, 13, 16, 17, 64, 65, 96, 97, 100, 130):
        assert torch.equal(OPS.linear(x[:num_rows], packed, out_features), full[:num_rows]), num_rows
        part = OPS.linear(x[300 : 300 + num_rows], packed, out_features)
        assert torch.equal(part, full[300 : 300 + num_rows]), num_rows
    torch.set_num_threads(1)
    assert torch.equal(OPS.linear(x, packed, out_features), full)
    assert torch.equal(OPS.linear(x[599:], packed, out_features), full[599:])


def test_refuses_mismatched_inputs():
    packed = OPS.pack_linear(torch.zeros(3, 8))
    with pytest.raises(RuntimeError, match="packed by pack_linear"):
        OPS.linear(torch.zeros(2, 9), packed, 3)
    with pytest.raises(RuntimeError, match="packed by pack_linear"):
        OPS.linear(torch.zeros(2, 8), packed, 40)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        OPS.linear(torch.zeros(2, 8, dtype=torch.float16), packed, 3)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        cpu_kernels.load().packed_shape(torch.zeros(3, 8, dtype=torch.float16))
    # A weight of a dtype the kernels do not multiply stays as it is, for torch's matmul.
    half = torch.zeros(3, 8, dtype=torch.float16)
    assert OPS.pack_linear(half) is half
    if torch.bfloat16 in cpu_kernels.linear_dtypes():
        with pytest.raises(RuntimeError, match="must be a BFloat16 weight packed by pack_linear"):
            OPS.linear(torch.zeros(2, 8, dtype=torch.bfloat16), packed, 3)
