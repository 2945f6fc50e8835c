"""Rill's CPU kernels (C++17, OpenMP, AVX-512 where the CPU has it): `CpuOps`, the CPU's `KernelOps`.

The sources in rill/kernels/csrc/cpu are compiled (rill.kernels.extension) with `-O3 -march=native -fopenmp`
into ~/.cache/rill/kernels/cpu-<hash>; the hash covers the sources, torch's version, the flags and this CPU's
feature flags (the binary is tied to them by -march=native), so the first start builds (about a minute) and
later starts only load. `python -m rill.kernels.build` builds ahead of time.

Every op has a torch reference in the shard (rill/shard/layers/attention.py, rill/shard/kv_cache.py,
rill/shard/layers/norm.py, rill/shard/layers/rotary.py, the Llama MLP); docs/kernels.md, "CPU kernels",
says which are bitwise equal to it and why paged attention is batch-invariant. Tensors: CPU, float32 or
bfloat16. Beyond the interface: `decoder_stack` (a run of Llama layers in one call) and `empty_huge_pages`.
This module imports nothing from rill.shard: kernels sit below the shard.
"""

from __future__ import annotations

import functools
import math
import mmap
import shutil
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from rill.kernels.extension import KernelSources, load_extension
from rill.kernels.ops import AttentionMetadata, KernelOps, run_fused_add_rms_norm
from rill.kernels.quant import ACTIVATIONS, QuantizedTensor

CSRC = Path(__file__).resolve().parent / "csrc"
# -ffp-contract=off: no implicit fused multiply-adds, so each product rounds where the torch reference rounds;
# the kernels ask for FMAs explicitly where they want them.
CFLAGS = ("-O3", "-march=native", "-fopenmp", "-ffp-contract=off")


def _cpu_flags() -> str:
    """The `flags` line of /proc/cpuinfo (what -march=native compiles for); empty where there is none."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


@functools.cache
def sources() -> KernelSources:
    return KernelSources(
        prefix="cpu",
        directory=CSRC,
        sources=tuple(
            f"cpu/{name}"
            for name in (
                "binding.cpp",
                "attention.cpp",
                "decoder.cpp",
                "elementwise.cpp",
                "linear.cpp",
                "lora.cpp",
                "quant.cpp",
                "rows.cpp",
            )
        ),
        headers=("cpu/ops.h", "cpu/vec.h", "torch_checks.h"),
        cflags=CFLAGS,
        ldflags=("-fopenmp",),
        machine=_cpu_flags(),
    )


@functools.cache
def load(verbose: bool = False) -> ModuleType:
    """Builds (first time on this machine) or loads (cached) the extension."""
    reason = CpuOps().unavailable_reason()
    if reason is not None:
        raise RuntimeError(reason)
    return load_extension(sources(), verbose)


class CpuOps(KernelOps):
    """Every op of `KernelOps`, optional ones included, on the CPU. `activations` (`quant.ACTIVATIONS`):
    what quantized weights multiply: float32 activations, or activations quantized per row to int8
    (llama.cpp's way: fastest, least exact) or to int16 (close to float32: each input within 1 / 64516 of its
    block's largest, finer than bfloat16; nearly as fast as int8 at one row)."""

    name = "cpu"
    kv_cache_dtypes = ("auto", "int8")

    def __init__(self, activations: str = "float32") -> None:
        if activations not in ACTIVATIONS:
            raise ValueError(f"activations must be one of {ACTIVATIONS}, got {activations!r}")
        self.activations = activations

    def unavailable_reason(self) -> str | None:
        if sources().is_built():
            return None
        if shutil.which("c++") is None and shutil.which("g++") is None:
            return "no C++ compiler (g++/c++) on PATH to build Rill's CPU kernels"
        if shutil.which("ninja") is None:
            try:
                import ninja  # noqa: F401 (only its presence matters: it puts the ninja binary on PATH)
            except ImportError:
                return "ninja not found (torch's extension builder needs it: `pip install ninja`)"
        return None

    def load(self, verbose: bool = False) -> ModuleType:
        return load(verbose)

    def attention_unsupported(
        self, head_dim: int, num_heads: int, num_kv_heads: int, sliding_window: int, softcap: float
    ) -> str | None:
        if head_dim % 16 != 0:
            return f"the CPU attention kernel needs a head_dim that is a multiple of 16, not {head_dim}"
        return None

    def k_pool_shape(
        self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> tuple[int, ...]:
        """bfloat16 on a CPU with AVX512-BF16, with block_size a multiple of 16, keeps K in pairs:
        [num_blocks, num_kv_heads, head_dim // 2, block_size, 2], row p of a block's KV head holding dims 2p
        and 2p + 1 of each of its slots, so attention scores 16 keys per instruction straight from the pool.
        Otherwise K is laid out as V."""
        if dtype == torch.bfloat16 and block_size % 16 == 0 and load().HAS_AVX512_BF16:
            return (num_blocks, num_kv_heads, head_dim // 2, block_size, 2)
        return (num_blocks, block_size, num_kv_heads, head_dim)

    def store_kv(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        k_pool: torch.Tensor,
        v_pool: torch.Tensor,
        slot_mapping: torch.Tensor,
        k_scale: torch.Tensor | None = None,
        v_scale: torch.Tensor | None = None,
    ) -> None:
        """int8 pools: k and v stay in the model's dtype (float32 or bfloat16), quantized from float32."""
        if k_scale is None:
            k, v = k.to(k_pool.dtype), v.to(v_pool.dtype)
        load().store_kv(k, v, k_pool, v_pool, slot_mapping, k_scale, v_scale)

    def paged_attention(
        self,
        q: torch.Tensor,
        k_pool: torch.Tensor,
        v_pool: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        sliding_window: int = 0,
        softcap: float = 0.0,
        k_scale: torch.Tensor | None = None,
        v_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """q may have any token stride (heads contiguous). The row for a query depends only on it and its
        keys, never on the rest of the batch or the thread count (each query walks its keys in fixed tiles
        from position 0). int8 pools are dequantized on the fly: a score is scale_k * (q . k_int8) and a V
        row enters the sum as (p * scale_v) * v_int8, in float32; the torch reference multiplies the rows out
        first, so the two agree within float32 rounding, not bitwise."""
        out = torch.empty(q.shape, dtype=q.dtype)
        load().paged_attention(
            out,
            q,
            k_pool,
            v_pool,
            meta.block_tables,
            meta.cu_seqlens_q,
            meta.positions,
            scale,
            sliding_window,
            softcap,
            k_scale,
            v_scale,
        )
        return out

    def fused_add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if weight.dtype != x.dtype:
            raise ValueError(f"weight dtype {weight.dtype} differs from x's {x.dtype}")
        return run_fused_add_rms_norm(load().fused_add_rms_norm, x, residual, weight, eps)

    def rotary_embedding(
        self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> None:
        """Every product and sum rounds as the torch reference's does."""
        load().rotary_embedding(q, k, cos.contiguous(), sin.contiguous())

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1]).contiguous()
        out = torch.empty((x2.shape[0], x2.shape[1] // 2), dtype=x.dtype)
        load().silu_and_mul(out, x2)
        return out.view(*x.shape[:-1], x.shape[-1] // 2)

    def pack_linear(self, weight: torch.Tensor) -> torch.Tensor:
        """float32 [ceil(out / 32), in, 32], bfloat16 [ceil(out / 32), ceil(in / 2), 32, 2] (pairs of inputs,
        on a CPU with AVX512-BF16), zero-padded past `out` (and `in`), in huge pages (`empty_huge_pages`). A
        weight of another dtype (bfloat16 without AVX512-BF16) stays as it is, and `linear` multiplies it with
        torch's matmul (oneDNN; no batch invariance promised)."""
        if weight.dtype not in linear_dtypes():
            return weight
        lib = load()
        packed = empty_huge_pages(tuple(lib.packed_shape(weight)), weight.dtype)
        lib.pack_linear(weight, packed)
        return packed

    def linear(self, x: torch.Tensor, packed: torch.Tensor, out_features: int) -> torch.Tensor:
        """In x's dtype (the packed weight's): the same bits for a row in a batch of 1 or 1000 and on any
        number of threads. float32: one fused multiply-add per input, in order; bfloat16: one AVX512-BF16 pair
        product per two inputs into a float32 sum, rounded to bfloat16 once. A quantized weight (uint8, from
        `pack_quantized`) multiplies float32 x with the same invariance, x as it is or (`activations`)
        quantized per row to int8 or int16 blocks of 32 (quant.cpp; `rill.kernels.quant.reference_linear`
        gives the exact value of each)."""
        if packed.dtype == torch.uint8:
            return load().linear(x, packed, out_features)
        if packed.dtype not in linear_dtypes():
            return x @ packed.T
        return load().linear(x, packed, out_features)

    def pack_quantized(self, parts: list[QuantizedTensor]) -> torch.Tensor:
        """One uint8 buffer in huge pages: a header, then each part's blocks, the file's bytes and no more
        (64-byte alignment aside; packed for integer activations, Q4_0 / Q4_1 / Q8_0 / Q4_K / Q5_K / Q6_K
        parts hold groups of 16 rows interleaved (8 on a CPU without AVX-512), the last group padded with zero
        rows: ops.h, "Quantized matrices")."""
        lib = load()
        columns = {part.columns for part in parts}
        if len(columns) != 1:
            raise ValueError(f"the parts of a quantized weight must have the same columns, got {columns}")
        qtypes, rows = [p.type_number for p in parts], [p.shape[0] for p in parts]
        code = ACTIVATIONS.index(self.activations)  # ops.h, QuantActivations
        size = lib.quant_packed_bytes(qtypes, rows, parts[0].columns, code)
        packed = empty_huge_pages((size,), torch.uint8)
        lib.pack_quantized(packed, [(p.type_number, p.data) for p in parts], parts[0].columns, code)
        return packed

    def dequantize_rows(self, packed: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return load().dequantize_rows(packed, ids)

    def lora_add(
        self,
        y: torch.Tensor,
        x: torch.Tensor,
        lora_a: torch.Tensor,
        lora_b: torch.Tensor,
        row_slots: torch.Tensor,
        part_ends: tuple[int, ...],
    ) -> None:
        """float32 or bfloat16 (on any CPU: the arithmetic is float32), y contiguous (written in place),
        row_slots int32; a slot outside [-1, S) is refused. Rounding against the reference (lora.cpp): each h
        entry is one dot over the inputs in 16 float32 lanes of fused multiply-adds and a fixed tree over the
        lanes, and each output's product one chain of fused multiply-adds over the R columns, where torch's
        matmul sums in its own order: equal within float32 rounding, not bitwise. Rounded to the dtype where
        the reference rounds (h, the product, the sum with y)."""
        load().lora_add(y, x.contiguous(), lora_a, lora_b, row_slots, list(part_ends))

    def argmax_rows(self, x: torch.Tensor) -> torch.Tensor:
        """A vectorised pass: torch's reduction with indices took ~350 us on [16, 49152] logits on 2 threads,
        this ~35 us."""
        return load().argmax_rows(x.contiguous())

    def softmax_stats(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return load().softmax_stats(x.contiguous())


def empty_huge_pages(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zero-filled CPU tensor in a memory mapping of its own that Linux is asked to back with transparent
    huge pages (`madvise(MADV_HUGEPAGE)`: 2 MB pages where THP is `always` or `madvise`). For the buffers a
    decode step reads in full, packed weights and the KV pool: with 4 KB pages, streaming them missed the TLB
    on every page (measured, 9 runs each, alternating: a batch-16, context-512 float32 decode step 43.9 ->
    42.3 ms on average, batch 32 82.0 -> 79.3 ms). Private memory: shared anonymous memory is shmem, which
    THP leaves alone by default."""
    num_bytes = math.prod(shape) * dtype.itemsize
    if num_bytes == 0:
        return torch.empty(shape, dtype=dtype)
    buffer = mmap.mmap(-1, num_bytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):  # Linux
        buffer.madvise(mmap.MADV_HUGEPAGE)
    return torch.frombuffer(buffer, dtype=dtype).view(shape)  # the tensor keeps the mapping alive


def linear_dtypes() -> tuple[torch.dtype, ...]:
    """The dtypes `CpuOps.linear` multiplies here: float32 always, bfloat16 where the build has
    AVX512-BF16."""
    return (torch.float32, torch.bfloat16) if load().HAS_AVX512_BF16 else (torch.float32,)


def decoder_layer_fields() -> tuple[tuple[str, bool], ...]:
    """(name, is_optional) of each weight of a decoder layer, in the order the C++ side declares them (ops.h,
    RILL_DECODER_LAYER_WEIGHTS): the one list both sides read."""
    return tuple(load().DECODER_LAYER_FIELDS)


def decoder_stack(
    layers: list[dict[str, Any]],
    *,
    intermediate_size: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    rms_norm_eps: float,
    scale: float,
) -> Any:
    """A run of Llama-family decoder layers (pre-norm RMSNorm, q/k/v, rotary, paged attention, o, gated SiLU
    MLP) whose `forward(hidden, residual, positions, cos, sin, k_pools, v_pools, block_tables, cu_seqlens_q,
    slot_mapping, lora_slots, k_scales, v_scales)` (the scale pools of int8 pools, one per layer, or empty
    lists) runs them all in one call and returns the last layer's (hidden, residual), as
    `LlamaDecoderLayer.forward` would, with the bits of the same kernels called one op at a time. Each layer
    is a dict of the `decoder_layer_fields` (projections packed by `CpuOps.pack_linear`, absent biases and
    LoRA stacks None; a projection's LoRA stacks are `lora_add`'s lora_a and lora_b) and `sliding_window`
    (0: none). `lora_slots` is `lora_add`'s row_slots, or None for no LoRA work. The weights are checked
    here, once."""
    lib = load()
    built = []
    for layer in layers:
        weights = lib.DecoderLayerWeights()
        for name, _ in decoder_layer_fields():
            setattr(weights, name, layer[name])
        weights.sliding_window = layer["sliding_window"]
        built.append(weights)
    return lib.DecoderStack(
        built,
        intermediate_size=intermediate_size,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        rms_norm_eps=rms_norm_eps,
        scale=scale,
    )
