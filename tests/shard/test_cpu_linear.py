"""`rill.kernels.cpu.linear`, the CPU kernels' matmul: against a float64 product, and batch-invariant bitwise.

Row r of x @ w^T must come out with the same bits whatever else is in x (a decode batch of 1, 16 or 64 rows, a
600-token prefill, a chunk of it) and whatever the thread count: the float32 invariance of the whole model
rests on it (MKL's own GEMM changes its reduction with the row count and, on 2 threads, at 64+ rows too).
"""

from __future__ import annotations

import pytest
import torch
from rill.kernels import cpu as cpu_kernels

# (in, out): the default model's shapes (qkv, o, gate/up, down), odd ones, and a K tail past the vector width.
SHAPES = [(576, 960), (576, 576), (576, 3072), (1536, 576), (100, 33), (48, 7)]
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


@pytest.fixture(autouse=True)
def restore_threads():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("in_features", "out_features"), SHAPES)
def test_matches_a_float64_product(dtype, in_features, out_features):
    generator = torch.Generator().manual_seed(in_features + out_features)
    w = torch.randn(out_features, in_features, generator=generator).to(dtype)
    x = torch.randn(37, in_features, generator=generator).to(dtype)
    expected = x.double() @ w.double().T
    for float32_out in (False, True):
        y = cpu_kernels.linear(x, w, float32_out)
        assert y.dtype == (torch.float32 if float32_out else dtype)
        error = ((y.double() - expected).abs().max() / expected.abs().max()).item()
        assert error <= TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("in_features", "out_features"), SHAPES)
def test_a_row_does_not_depend_on_the_batch_or_the_threads(dtype, in_features, out_features):
    generator = torch.Generator().manual_seed(7)
    w = torch.randn(out_features, in_features, generator=generator).to(dtype)
    x = torch.randn(600, in_features, generator=generator).to(dtype)
    torch.set_num_threads(2)
    full = cpu_kernels.linear(x, w)
    for num_rows in (1, 2, 3, 5, 16, 17, 64, 65, 100, 130):
        assert torch.equal(cpu_kernels.linear(x[:num_rows], w), full[:num_rows]), num_rows
        assert torch.equal(cpu_kernels.linear(x[300 : 300 + num_rows], w), full[300 : 300 + num_rows])
    torch.set_num_threads(1)
    assert torch.equal(cpu_kernels.linear(x, w), full)
    assert torch.equal(cpu_kernels.linear(x[599:], w), full[599:])


def test_refuses_mismatched_inputs():
    with pytest.raises(RuntimeError, match="linear needs x"):
        cpu_kernels.linear(torch.zeros(2, 8), torch.zeros(3, 9))
    with pytest.raises(RuntimeError, match="dtype"):
        cpu_kernels.linear(torch.zeros(2, 8), torch.zeros(3, 8, dtype=torch.bfloat16))
