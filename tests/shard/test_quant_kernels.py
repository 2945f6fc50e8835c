"""The CPU kernels on quantized weights (quant.cpp): every ggml type they take, against independent oracles.

- `dequantize_rows` equals the `gguf` package's numpy de-quantization bitwise, also from a matrix whose rows
  are interleaved (packed for int8 activations).
- `linear` on a quantized matrix, with float32 activations or int8 or int16 ones (`CpuOps(activations=...)`),
  equals `rill.kernels.quant.reference_linear` (x, or x quantized per row as the kernels do, times the
  de-quantized weight, in float64) within float32 rounding of its sums.
- A row's bits do not depend on the batch (1 to 600 rows), the thread count, nor the path (the portable C++
  and the AVX2 one, with AVX512-VNNI's integer sums where the CPU has it, are bitwise equal); a matrix of
  mixed parts is its parts' products side by side.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from rill.kernels import cpu as cpu_kernels
from rill.kernels.quant import ACTIVATIONS, QTYPES, QuantizedTensor, dequantize, quantize, reference_linear

ALL = pytest.mark.parametrize(
    "ops", [cpu_kernels.CpuOps(activations) for activations in ACTIVATIONS], ids=lambda ops: ops.activations
)
# Byte offsets of each block's float16 fields: (scale fields, min fields); the rest are quants and int scales.
HALF_FIELDS = {
    "Q4_0": ([0], []),
    "Q4_1": ([0], [2]),
    "Q5_0": ([0], []),
    "Q5_1": ([0], [2]),
    "Q8_0": ([0], []),
    "Q4_K": ([0], [2]),
    "Q5_K": ([0], [2]),
    "Q6_K": ([208], []),
}


@pytest.fixture(autouse=True)
def restore_threads():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def random_quantized(qtype: str, rows: int, columns: int, seed: int) -> QuantizedTensor:
    """Random blocks of `qtype` whose float16 scales are of a trained model's size (random quants and int
    scales)."""
    _, block, block_bytes = QTYPES[qtype]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(rows * columns // block, block_bytes), dtype=np.uint8)
    scales, mins = HALF_FIELDS[qtype]
    for offset in scales:
        blocks[:, offset : offset + 2] = (
            rng.uniform(0.002, 0.02, len(blocks)).astype(np.float16).view(np.uint8).reshape(-1, 2)
        )
    for offset in mins:
        value = rng.uniform(-0.1, 0.1, len(blocks)).astype(np.float16)
        blocks[:, offset : offset + 2] = value.view(np.uint8).reshape(-1, 2)
    return QuantizedTensor(qtype, torch.from_numpy(blocks.reshape(rows, -1)), columns)


def columns_for(qtype: str) -> list[int]:
    return [256, 1536] if QTYPES[qtype][1] == 256 else [64, 576, 1536]


@ALL
@pytest.mark.parametrize("qtype", sorted(QTYPES))
def test_dequantize_rows_equals_gguf_bitwise(qtype, ops):
    """Packed for integer activations, Q4_0 / Q4_1 / Q8_0 / Q4_K / Q5_K / Q6_K rows are interleaved by 16 or 8
    (43 rows: the last group padded); every row still reads back as the file has it."""
    lib = cpu_kernels.load()
    for columns in columns_for(qtype):
        weight = random_quantized(qtype, 43, columns, seed=columns)
        packed = ops.pack_quantized([weight])
        rows = ops.dequantize_rows(packed, torch.arange(43))
        assert torch.equal(rows, dequantize(weight))
        picked = torch.tensor([42, 0, 7, 7, 8])
        assert torch.equal(ops.dequantize_rows(packed, picked), dequantize(weight)[picked])
        assert torch.equal(lib.quant_file_rows(packed, 0), weight.data)


@ALL
@pytest.mark.parametrize("qtype", sorted(QTYPES))
def test_linear_matches_its_exact_value(qtype, ops):
    for columns in columns_for(qtype):
        weight = random_quantized(qtype, 70, columns, seed=columns + 1)
        packed = ops.pack_quantized([weight])
        x = torch.randn(33, columns, generator=torch.Generator().manual_seed(columns))
        y = ops.linear(x, packed, 70)
        expected = reference_linear(x, [weight], ops.activations)
        assert y.dtype == torch.float32 and y.shape == (33, 70)
        # float32 sums of exact integer block products: within a few float32 roundings of the sum of the
        # terms' magnitudes.
        magnitude = (x.double().abs() @ dequantize(weight).double().abs().T).max()
        error = ((y.double() - expected).abs().max() / magnitude).item()
        assert error <= 1e-6, error


@pytest.mark.parametrize(("activations", "bound"), [("int8", 0.02), ("int16", 1e-4)])
@pytest.mark.parametrize("qtype", sorted(QTYPES))
def test_integer_activations_stay_close_to_the_float_product(qtype, activations, bound):
    """The price of integer activations: against x (unquantized) times the de-quantized weight; int16's is
    below bfloat16 activations' own (x rounded to bfloat16 first)."""
    weight = random_quantized(qtype, 64, 1536, seed=5)
    x = torch.randn(16, 1536, generator=torch.Generator().manual_seed(6))
    exact = x.double() @ dequantize(weight).double().T
    ops = cpu_kernels.CpuOps(activations)
    y = ops.linear(x, ops.pack_quantized([weight]), 64)
    error = ((y.double() - exact).norm() / exact.norm()).item()
    assert error < bound, error
    if activations == "int16":
        bfloat16 = x.bfloat16().double() @ dequantize(weight).double().T
        assert error < ((bfloat16 - exact).norm() / exact.norm()).item() / 10


@ALL
@pytest.mark.parametrize("qtype", sorted(QTYPES))
def test_rows_do_not_depend_on_the_batch_threads_or_path(qtype, ops):
    columns = columns_for(qtype)[-1]
    weight = random_quantized(qtype, 96, columns, seed=11)
    packed = ops.pack_quantized([weight])
    x = torch.randn(600, columns, generator=torch.Generator().manual_seed(12))
    torch.set_num_threads(2)
    full = ops.linear(x, packed, 96)
    lib = cpu_kernels.load()
    for rows in (1, 2, 7, 8, 9, 16, 63, 64, 65, 130):
        assert torch.equal(ops.linear(x[:rows], packed, 96), full[:rows]), rows
        assert torch.equal(ops.linear(x[-rows:], packed, 96), full[-rows:]), rows
    torch.set_num_threads(1)
    assert torch.equal(ops.linear(x, packed, 96), full)
    assert torch.equal(lib.quantized_linear(x[:40], packed, portable=True), full[:40])


@ALL
def test_mixed_parts_are_their_products_side_by_side(ops):
    """A fused q/k/v of a Q4_K_M file mixes types: each part's columns are its own product, bitwise (row
    counts that leave an interleaved part's last group short, and a Q5_1 part kept row by row)."""
    parts = [random_quantized("Q4_K", 60, 512, 1), random_quantized("Q6_K", 29, 512, 2),
             random_quantized("Q5_K", 39, 512, 3), random_quantized("Q5_1", 21, 512, 5)]  # fmt: skip
    x = torch.randn(5, 512, generator=torch.Generator().manual_seed(4))
    fused = ops.linear(x, ops.pack_quantized(parts), 149)
    alone = torch.cat([ops.linear(x, ops.pack_quantized([part]), part.shape[0]) for part in parts], dim=1)
    assert torch.equal(fused, alone)
    ids = torch.tensor([0, 59, 60, 88, 89, 127, 128, 148])
    assert torch.equal(
        ops.dequantize_rows(ops.pack_quantized(parts), ids), torch.cat([dequantize(p) for p in parts])[ids]
    )


@ALL
@pytest.mark.parametrize("qtype", ["Q4_1", "Q6_K"])
def test_packed_matrix_holds_the_file_bytes_and_no_more(qtype, ops):
    weight = random_quantized(qtype, 960, 1536, seed=3)
    packed = ops.pack_quantized([weight])
    assert packed.dtype == torch.uint8 and packed.numel() - weight.data.numel() <= 256


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0"])
def test_quantize_round_trips_within_the_type_step(qtype):
    w = torch.randn(32, 256, generator=torch.Generator().manual_seed(8))
    back = dequantize(quantize(w, qtype))
    # Q8_0: half a step of max|w| / 127 (the float16 scale adds its own rounding); Q4_0 maps the signed
    # extreme to -8 steps of max|w| / 8, so the other side may be a whole step away.
    step = w.abs().reshape(32, -1, 32).amax(-1, keepdim=True) / (127 if qtype == "Q8_0" else 8)
    bound = 0.6 if qtype == "Q8_0" else 1.02
    assert ((back - w).abs().reshape(32, -1, 32) <= step * bound + 1e-6).all()


def test_bad_matrices_are_refused():
    weight = random_quantized("Q8_0", 4, 64, seed=1)
    ops = cpu_kernels.CpuOps()
    packed = ops.pack_quantized([weight])
    with pytest.raises(RuntimeError, match="float32"):
        ops.linear(torch.randn(2, 64).bfloat16(), packed, 4)
    with pytest.raises(RuntimeError, match=r"\[M, 64\]"):
        ops.linear(torch.randn(2, 32), packed, 4)
    with pytest.raises(RuntimeError, match="outside"):
        ops.dequantize_rows(packed, torch.tensor([4]))
    corrupted = packed.clone()
    corrupted[0] ^= 1
    with pytest.raises(RuntimeError, match="magic"):
        ops.linear(torch.randn(2, 64), corrupted, 4)
    with pytest.raises(ValueError, match="multiples of 256"):
        QuantizedTensor("Q4_K", torch.zeros(1, 144, dtype=torch.uint8), 128)
