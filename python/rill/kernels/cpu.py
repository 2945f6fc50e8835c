"""Rill's CPU kernels (C++17, OpenMP, AVX-512 where the CPU has it): build once, cached, and thin wrappers.

The sources in rill/kernels/csrc/cpu are compiled by `torch.utils.cpp_extension.load` with
`-O3 -march=native -fopenmp` into ~/.cache/rill/kernels/cpu-<hash>; the hash covers the sources, torch's
version, the flags and this CPU's feature flags (the binary is tied to them by -march=native), so the first
start builds (about a minute) and later starts only load. `python -m rill.kernels.build` builds ahead of time.

Every op has a torch reference in the shard (rill/shard/layers/attention.py, rill/shard/kv_cache.py,
rill/shard/layers/norm.py, rill/shard/layers/rotary.py, the Llama MLP); docs/kernels.md, "CPU kernels",
says which are bitwise equal to it and why paged attention is batch-invariant. Tensors: CPU, float32 or
bfloat16.
This module imports nothing from rill.shard: kernels sit below the shard.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import logging
import math
import mmap
import shutil
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

CSRC = Path(__file__).resolve().parent / "csrc" / "cpu"
SOURCES = ("binding.cpp", "attention.cpp", "decoder.cpp", "elementwise.cpp", "linear.cpp", "rows.cpp")
HEADERS = ("ops.h", "vec.h")
# -ffp-contract=off: no implicit fused multiply-adds, so each product rounds where the torch reference rounds;
# the kernels ask for FMAs explicitly where they want them.
CFLAGS = ("-O3", "-march=native", "-fopenmp", "-ffp-contract=off")
LDFLAGS = ("-fopenmp",)

logger = logging.getLogger(__name__)


def cache_root() -> Path:
    return Path.home() / ".cache" / "rill" / "kernels"


def _cpu_flags() -> str:
    """The `flags` line of /proc/cpuinfo (what -march=native compiles for); empty where there is none."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def build_key() -> str:
    digest = hashlib.sha256()
    for name in SOURCES + HEADERS:
        digest.update(name.encode())
        digest.update((CSRC / name).read_bytes())
    digest.update(f"{torch.__version__}|{' '.join(CFLAGS)}|{' '.join(LDFLAGS)}|{_cpu_flags()}".encode())
    return digest.hexdigest()[:16]


def build_dir() -> Path:
    return cache_root() / f"cpu-{build_key()}"


def _library_name() -> str:
    return f"rill_cpu_kernels_{build_key()}"


def is_built() -> bool:
    return (build_dir() / f"{_library_name()}.so").is_file()


def unavailable_reason() -> str | None:
    """Why the kernels cannot be used here (None: they can), for a clear log line."""
    if is_built():
        return None
    if shutil.which("c++") is None and shutil.which("g++") is None:
        return "no C++ compiler (g++/c++) on PATH to build Rill's CPU kernels"
    if shutil.which("ninja") is None:
        try:
            import ninja  # noqa: F401 (only its presence matters: it puts the ninja binary on PATH)
        except ImportError:
            return "ninja not found (torch's extension builder needs it: `pip install ninja`)"
    return None


def is_available() -> bool:
    """The library is cached, or it can be built (a C++ compiler and ninja are present)."""
    return unavailable_reason() is None


@functools.cache
def load(verbose: bool = False) -> ModuleType:
    """Builds (first time on this machine) or loads (cached) the extension. A cached library is imported
    directly: a later start needs neither the compiler nor ninja."""
    if is_built():
        return _import_library()
    reason = unavailable_reason()
    if reason is not None:
        raise RuntimeError(reason)
    from torch.utils import cpp_extension

    directory = build_dir()
    directory.mkdir(parents=True, exist_ok=True)
    logger.info("building Rill's CPU kernels (once, ~1 min) into %s", directory)
    start = time.perf_counter()
    module = cpp_extension.load(
        name=_library_name(),
        sources=[str(CSRC / name) for name in SOURCES],
        extra_cflags=list(CFLAGS),
        extra_ldflags=list(LDFLAGS),
        build_directory=str(directory),
        verbose=verbose,
    )
    logger.info("built Rill's CPU kernels in %.0f s", time.perf_counter() - start)
    return module


def _import_library() -> ModuleType:
    name = _library_name()
    spec = importlib.util.spec_from_file_location(name, build_dir() / f"{name}.so")
    assert spec is not None and spec.loader is not None, "a file location always gives a spec with a loader"
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def paged_attention(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    positions: torch.Tensor,
    scale: float,
    sliding_window: int = 0,
    softcap: float = 0.0,
) -> torch.Tensor:
    """Causal attention of every query row through the paged pool, in one call for the whole batch.

    q: [num_tokens, num_heads, head_dim] (heads contiguous, any token stride); the pools as `store_kv`
    writes them; sequence i owns rows
    cu_seqlens_q[i]:cu_seqlens_q[i+1] and reads its keys through block_tables[i] (int64, padded with block 0);
    a query at positions[t] = p sees its sequence's keys 0..p (with sliding_window > 0, only those
    > p - sliding_window; with softcap > 0, scores become softcap * tanh(score / softcap)). Query head h uses
    KV head h // (num_heads // num_kv_heads). Returns [num_tokens, num_heads, head_dim] in q's dtype; the row
    for a query depends only on it and its keys, never on the rest of the batch or the thread count.
    """
    out = torch.empty(q.shape, dtype=q.dtype)
    load().paged_attention(
        out, q, k_pool, v_pool, block_tables, cu_seqlens_q, positions, scale, sliding_window, softcap
    )
    return out


def k_pool_shape(
    num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> tuple[int, ...]:
    """The shape of a K pool for these kernels (V pools are always [num_blocks, block_size, num_kv_heads,
    head_dim]). bfloat16 on a CPU with AVX512-BF16, with block_size a multiple of 16, keeps K in pairs:
    [num_blocks, num_kv_heads, head_dim // 2, block_size, 2], row p of a block's KV head holding dims 2p and
    2p + 1 of each of its slots, so attention scores 16 keys per instruction straight from the pool. Otherwise
    K is laid out as V."""
    if dtype == torch.bfloat16 and block_size % 16 == 0 and load().HAS_AVX512_BF16:
        return (num_blocks, num_kv_heads, head_dim // 2, block_size, 2)
    return (num_blocks, block_size, num_kv_heads, head_dim)


def store_kv(
    k: torch.Tensor, v: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Writes k, v [num_tokens, num_kv_heads, head_dim] into flat slots `slot_mapping` (< 0: skipped) of the
    pools (`k_pool_shape`; v_pool [num_blocks, block_size, num_kv_heads, head_dim]), converting to the pool's
    dtype first."""
    load().store_kv(k.to(k_pool.dtype), v.to(v_pool.dtype), k_pool, v_pool, slot_mapping)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(rmsnorm(x + residual), x + residual), or (rmsnorm(x), None) without a residual.
    weight must have x's dtype."""
    if weight.dtype != x.dtype:
        raise ValueError(f"weight dtype {weight.dtype} differs from x's {x.dtype}")
    shape = x.shape
    x2 = x.reshape(-1, shape[-1]).contiguous()
    res2 = None if residual is None else residual.reshape(-1, shape[-1]).contiguous()
    out = torch.empty_like(x2)
    residual_out = torch.empty_like(x2) if res2 is not None else out
    load().fused_add_rms_norm(out, residual_out, x2, res2, weight.contiguous(), eps)
    return out.view(shape), (None if res2 is None else residual_out.view(shape))


def rotary_embedding(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotates q [num_tokens, num_heads, head_dim] and k [num_tokens, num_kv_heads, head_dim] in place
    (rotate-half) by cos, sin [num_tokens, head_dim / 2] in q's dtype (the caller's table: the attention
    factor of yarn/longrope included). Every product and sum rounds as the torch reference's does."""
    load().rotary_embedding(q, k, cos.contiguous(), sin.contiguous())


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [num_tokens, 2 * I] -> silu(x[:, :I]) * x[:, I:], in x's dtype."""
    x2 = x.reshape(-1, x.shape[-1]).contiguous()
    out = torch.empty((x2.shape[0], x2.shape[1] // 2), dtype=x.dtype)
    load().silu_and_mul(out, x2)
    return out.view(*x.shape[:-1], x.shape[-1] // 2)


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """The index of each row's first maximum, int64 [rows], for float32 x [rows, n] (torch's
    `x.max(dim=-1).indices`, a NaN counting as the maximum), in a vectorised pass: torch's reduction with
    indices took ~350 us on [16, 49152] logits on 2 threads, this ~35 us."""
    return load().argmax_rows(x.contiguous())


def softmax_stats(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's max and the log of its sum of exp(x - max), float32 [rows] each, for float32 x [rows, n]:
    log_softmax(x)[:, j] = (x[:, j] - max) - log_sum, without writing the [rows, n] result."""
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
    """The dtypes `linear` multiplies here: float32 always, bfloat16 where the build has AVX512-BF16."""
    return (torch.float32, torch.bfloat16) if load().HAS_AVX512_BF16 else (torch.float32,)


def pack_linear(weight: torch.Tensor) -> torch.Tensor:
    """A weight [out, in] (a dtype of `linear_dtypes()`) repacked for `linear`: float32
    [ceil(out / 32), in, 32], bfloat16 [ceil(out / 32), ceil(in / 2), 32, 2] (pairs of inputs), zero-padded
    past `out` (and `in`), in huge pages (`empty_huge_pages`)."""
    lib = load()
    packed = empty_huge_pages(tuple(lib.packed_shape(weight)), weight.dtype)
    lib.pack_linear(weight, packed)
    return packed


def linear(x: torch.Tensor, packed: torch.Tensor, out_features: int) -> torch.Tensor:
    """x [rows, in] @ weight [out_features, in]^T in x's dtype (the packed weight's), the weight packed by
    `pack_linear`. Row r of the result depends only on row r of x: the same bits in a batch of 1 or 1000 and
    on any number of threads. float32: one fused multiply-add per input, in order; bfloat16: one AVX512-BF16
    pair product per two inputs into a float32 sum, rounded to bfloat16 once."""
    return load().linear(x, packed, out_features)


def decoder_stack(
    layers: list[dict[str, Any]],
    final_norm: torch.Tensor,
    *,
    intermediate_size: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    rms_norm_eps: float,
    scale: float,
) -> Any:
    """A Llama-family decoder stack (pre-norm RMSNorm, q/k/v, rotary, paged attention, o, gated SiLU MLP)
    whose `forward(embedded, positions, cos, sin, k_pools, v_pools, block_tables, cu_seqlens_q,
    slot_mapping)` runs every layer in one call and returns the final norm's output; its bits are those of
    the same kernels called one layer op at a time. Each layer is a dict of input_norm, qkv, qkv_bias,
    o_proj, o_proj_bias, post_norm, gate_up, gate_up_bias, down, down_bias (projections packed by
    `pack_linear`, biases or None) and sliding_window (0: none). The weights are checked here, once."""
    lib = load()
    return lib.DecoderStack(
        [lib.DecoderLayerWeights(**layer) for layer in layers],
        final_norm,
        intermediate_size=intermediate_size,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        rms_norm_eps=rms_norm_eps,
        scale=scale,
    )
