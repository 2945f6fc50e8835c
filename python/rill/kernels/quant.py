"""Quantized weights as GGUF files hold them: rows of ggml blocks, kept as they are.

A `QuantizedTensor` is one such matrix (or a run of its rows): its ggml type and its bytes, uint8 [rows,
row_bytes]. The CPU kernels multiply a matrix made of up to four of them (a fused q/k/v may mix types) as it
is (`CpuOps.pack_quantized`, `CpuOps.linear`); this module holds the plain references they are tested against:
`dequantize` (the `gguf` package's de-quantization, an implementation independent of Rill's), the per-token
activation quantization the kernels apply, and `reference_linear`, the exact value of the kernels' integer
product. `quantize` makes Q8_0 / Q4_0 matrices from float weights (`--quantize`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

# ggml's type numbers and blocks (inputs, bytes) of the types the kernels multiply.
QTYPES: dict[str, tuple[int, int, int]] = {
    "Q4_0": (2, 32, 18),
    "Q4_1": (3, 32, 20),
    "Q5_0": (6, 32, 22),
    "Q5_1": (7, 32, 24),
    "Q8_0": (8, 32, 34),
    "Q4_K": (12, 256, 144),
    "Q5_K": (13, 256, 176),
    "Q6_K": (14, 256, 210),
}
ACTIVATION_BLOCK = 32  # inputs per integer activation block (one float scale each)
# What quantized weights multiply (the kernels' code for each is its index): x as it is, or x quantized per
# row in blocks of 32 to int8 (llama.cpp's way) or to int16 (two int8 digits; an input's error at most
# 1 / 64516 of its block's largest).
ACTIVATIONS = ("float32", "int8", "int16")
ACTIVATION_LEVELS = {"int8": 127, "int16": 127 * 254}  # the largest |q| of a block


@dataclass(frozen=True)
class QuantizedTensor:
    """A matrix [rows, columns] of ggml blocks of `qtype`, `data` uint8 [rows, row_bytes]."""

    qtype: str
    data: torch.Tensor
    columns: int

    def __post_init__(self) -> None:
        if self.qtype not in QTYPES:
            raise ValueError(f"quantized type {self.qtype} is not one of {sorted(QTYPES)}")
        _, block, block_bytes = QTYPES[self.qtype]
        if self.columns % block != 0:
            raise ValueError(f"{self.qtype} needs columns in multiples of {block}, got {self.columns}")
        expected = (self.data.shape[0], self.columns // block * block_bytes)
        if self.data.dtype != torch.uint8 or self.data.dim() != 2 or tuple(self.data.shape) != expected:
            raise ValueError(f"{self.qtype} data must be uint8 {expected}, got {self.data.dtype} "
                             f"{tuple(self.data.shape)}")  # fmt: skip

    @property
    def shape(self) -> tuple[int, int]:
        return (self.data.shape[0], self.columns)

    @property
    def type_number(self) -> int:
        return QTYPES[self.qtype][0]

    def rows(self, start: int, size: int) -> QuantizedTensor:
        return QuantizedTensor(self.qtype, self.data[start : start + size], self.columns)

    def select_rows(self, index: torch.Tensor) -> QuantizedTensor:
        return QuantizedTensor(self.qtype, self.data[index], self.columns)


def dequantize(tensor: QuantizedTensor) -> torch.Tensor:
    """float32 [rows, columns], by the `gguf` package's numpy de-quantization."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize as gguf_dequantize

    values = gguf_dequantize(tensor.data.numpy(), GGMLQuantizationType[tensor.qtype])
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).view(tensor.shape)


def quantize(weight: torch.Tensor, qtype: str) -> QuantizedTensor:
    """A float weight [rows, columns] as `qtype` blocks, by the `gguf` package's quantization (Q8_0, Q4_0:
    llama.cpp's reference rounding)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize as gguf_quantize

    data = gguf_quantize(weight.detach().float().contiguous().numpy(), GGMLQuantizationType[qtype])
    return QuantizedTensor(qtype, torch.from_numpy(np.ascontiguousarray(data)), weight.shape[1])


def quantize_activations(x: torch.Tensor, activations: str) -> tuple[torch.Tensor, torch.Tensor]:
    """What the kernels do to each row of float32 x [rows, k] before the product with integer `activations`:
    blocks of 32 inputs, scale d = max|x| / levels (127, or 127 * 254 for int16), q = round-half-even(x * (1 /
    d)) (0 where d is 0). Returns q (float32 integers, [rows, k]) and d [rows, k / 32]."""
    blocks = x.reshape(x.shape[0], -1, ACTIVATION_BLOCK)
    d = blocks.abs().amax(dim=-1) / float(ACTIVATION_LEVELS[activations])
    inverse = torch.where(d != 0, 1.0 / torch.where(d != 0, d, 1.0), 0.0)
    q = torch.round(blocks * inverse.unsqueeze(-1))
    return q.reshape(x.shape), d


def reference_linear(x: torch.Tensor, parts: list[QuantizedTensor], activations: str) -> torch.Tensor:
    """x @ w^T as the kernels define it, in float64: x (or x quantized per row, `quantize_activations`) times
    the de-quantized weight. The kernels compute this sum in float32 (lane chains of fused multiply-adds per
    output; with integer activations over exact integer block sums), so they differ from it by float32
    rounding only."""
    x_used = x.double()
    if activations != "float32":
        q, d = quantize_activations(x.float(), activations)
        x_used = (q.double().reshape(x.shape[0], -1, ACTIVATION_BLOCK) * d.double().unsqueeze(-1)).reshape(
            x.shape
        )
    weight = torch.cat([dequantize(part) for part in parts]).double()
    return x_used @ weight.T
