"""`rill.kernels.cpu.linear`, the CPU kernels' float32 matmul: against a float64 product, its documented
arithmetic exactly, and batch-invariant bitwise.

Row r of x @ w^T must come out with the same bits whatever else is in x (a decode batch of 1, 16 or 64 rows, a
600-token prefill, a chunk of it) and whatever the thread count: the float32 invariance of the whole model
rests on it (MKL's own GEMM changes its reduction with the row count and, on 2 threads, at 64+ rows too).
"""

from __future__ import annotations

import pytest
import torch
from rill.kernels import cpu as cpu_kernels

# (in, out): the default model's shapes (qkv, o, gate/up, down); odd ones with output tails.
SHAPES = [(576, 960), (576, 576), (576, 3072), (1536, 576), (100, 33), (48, 7)]


@pytest.fixture(autouse=True)
def restore_threads():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def random_weight(in_features: int, out_features: int, seed: int) -> tuple[torch.Tensor, torch.Generator]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(out_features, in_features, generator=generator), generator


@pytest.mark.parametrize(("in_features", "out_features"), SHAPES)
def test_matches_a_float64_product(in_features, out_features):
    w, generator = random_weight(in_features, out_features, in_features + out_features)
    x = torch.randn(37, in_features, generator=generator)
    expected = x.double() @ w.double().T
    y = cpu_kernels.linear(x, cpu_kernels.pack_linear(w), out_features)
    assert y.dtype == torch.float32 and y.shape == (37, out_features)
    error = ((y.double() - expected).abs().max() / expected.abs().max()).item()
    assert error <= 1e-5


def test_each_output_is_one_ascending_fma_chain():
    """The documented arithmetic: y[r, n] = fma(x[r, K-1], w[n, K-1], ... fma(x[r, 0], w[n, 0], 0))."""
    w, generator = random_weight(40, 35, 3)
    x = torch.randn(5, 40, generator=generator)
    expected = torch.zeros(5, 35, dtype=torch.float64)
    for step in range(40):  # float64 product + sum of two float32 values, rounded once: a float32 FMA
        expected = (expected + x[:, step, None].double() * w[None, :, step].double()).float().double()
    y = cpu_kernels.linear(x, cpu_kernels.pack_linear(w), 35)
    assert torch.equal(y, expected.float())


@pytest.mark.parametrize(("in_features", "out_features"), SHAPES)
def test_a_row_does_not_depend_on_the_batch_or_the_threads(in_features, out_features):
    w, generator = random_weight(in_features, out_features, 7)
    packed = cpu_kernels.pack_linear(w)
    x = torch.randn(600, in_features, generator=generator)
    torch.set_num_threads(2)
    full = cpu_kernels.linear(x, packed, out_features)
    for num_rows in (1, 2, 3, 5, 12, 13, 16, 17, 64, 65, 96, 97, 100, 130):
        assert torch.equal(cpu_kernels.linear(x[:num_rows], packed, out_features), full[:num_rows]), num_rows
        part = cpu_kernels.linear(x[300 : 300 + num_rows], packed, out_features)
        assert torch.equal(part, full[300 : 300 + num_rows]), num_rows
    torch.set_num_threads(1)
    assert torch.equal(cpu_kernels.linear(x, packed, out_features), full)
    assert torch.equal(cpu_kernels.linear(x[599:], packed, out_features), full[599:])


def test_refuses_mismatched_inputs():
    packed = cpu_kernels.pack_linear(torch.zeros(3, 8))
    with pytest.raises(RuntimeError, match="packed by pack_linear"):
        cpu_kernels.linear(torch.zeros(2, 9), packed, 3)
    with pytest.raises(RuntimeError, match="packed by pack_linear"):
        cpu_kernels.linear(torch.zeros(2, 8), packed, 40)
    with pytest.raises(RuntimeError, match="float32"):
        cpu_kernels.linear(torch.zeros(2, 8, dtype=torch.bfloat16), packed, 3)
    with pytest.raises(RuntimeError, match="float32"):
        cpu_kernels.pack_linear(torch.zeros(3, 8, dtype=torch.bfloat16))
