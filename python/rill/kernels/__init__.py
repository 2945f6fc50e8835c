"""Rill's CUDA kernels: build (once, cached by source hash) and thin Python wrappers.

The sources in rill/kernels/csrc are compiled by `torch.utils.cpp_extension.load` on first use into
~/.cache/rill/kernels/<hash> (the hash covers the sources, torch's version and the target archs), so a later
start only loads the cached library. `python -m rill.kernels.build` builds it ahead of time (e.g. at install
time).
nvcc comes from the CUDA toolkit on PATH / CUDA_HOME, or from the PyPI wheels (`pip install "rill[cuda]"`).

Every op here has a torch reference in the shard (rill/shard/layers/attention.py, rill/shard/kv_cache.py,
rill/shard/layers/norm.py, rill/shard/layers/rotary.py); the shard picks these on CUDA and the references on
the CPU.
Outputs are allocated here with torch (no host syncs), so every op can be captured in a CUDA graph.
"""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
from pathlib import Path
from types import ModuleType

import torch

CSRC = Path(__file__).resolve().parent / "csrc"
SOURCES = ("binding.cpp", "attention.cu", "cache.cu", "norm_rotary.cu")
HEADERS = ("common.cuh", "ops.h")
SUPPORTED_HEAD_DIMS = (64, 128)
MAX_GROUP_SIZE = 16  # query heads per KV head; kMaxGroupSize in ops.h
# Decode split heuristic: aim for this many CTAs per SM, never fewer than this many keys per split.
DECODE_CTAS_PER_SM = 8
MIN_TOKENS_PER_SPLIT = 256
MAX_SPLITS = 64


def cache_root() -> Path:
    return Path.home() / ".cache" / "rill" / "kernels"


def pip_cuda_home() -> Path | None:
    """The CUDA 13 toolkit that the nvidia-cuda-nvcc / -crt / nvvm wheels lay out in site-packages."""
    try:
        import nvidia  # noqa: F401 (namespace package of the CUDA wheels; only its path is used)
    except ImportError:
        return None
    for base in nvidia.__path__:
        for sub in ("cu13", "cuda_nvcc"):
            home = Path(base) / sub
            if (home / "bin" / "nvcc").is_file():
                return home
    return None


def find_cuda_home() -> Path | None:
    for candidate in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")):
        if candidate and (Path(candidate) / "bin" / "nvcc").is_file():
            return Path(candidate)
    nvcc = shutil.which("nvcc")
    if nvcc:
        return Path(nvcc).resolve().parent.parent
    return pip_cuda_home()


def is_available() -> bool:
    """A CUDA device is present and nvcc can be found (or the library is already built)."""
    return torch.cuda.is_available() and find_cuda_home() is not None


def _arch_list() -> str:
    if os.environ.get("TORCH_CUDA_ARCH_LIST"):
        return os.environ["TORCH_CUDA_ARCH_LIST"]
    archs = sorted({torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())})
    return ";".join(f"{major}.{minor}" for major, minor in archs)


def source_hash(arch_list: str) -> str:
    digest = hashlib.sha256()
    for name in SOURCES + HEADERS:
        digest.update(name.encode())
        digest.update((CSRC / name).read_bytes())
    digest.update(f"{torch.__version__}|{torch.version.cuda}|{arch_list}".encode())
    return digest.hexdigest()[:16]


@functools.cache
def load(verbose: bool = False) -> ModuleType:
    """Builds (first time) or loads (cached) the extension for this machine's GPUs."""
    cuda_home = find_cuda_home()
    if cuda_home is None:
        raise RuntimeError("nvcc not found: install the CUDA toolkit or `pip install 'rill[cuda]'`")
    arch_list = _arch_list()
    # torch.utils.cpp_extension reads CUDA_HOME when imported and the arch list from the environment.
    os.environ.setdefault("CUDA_HOME", str(cuda_home))
    os.environ["TORCH_CUDA_ARCH_LIST"] = arch_list
    from torch.utils import cpp_extension

    cpp_extension.CUDA_HOME = str(cuda_home)
    key = source_hash(arch_list)
    build_dir = cache_root() / key
    build_dir.mkdir(parents=True, exist_ok=True)
    lib_dir = cuda_home / "lib64" if (cuda_home / "lib64").is_dir() else cuda_home / "lib"
    return cpp_extension.load(
        name=f"rill_kernels_{key}",
        sources=[str(CSRC / name) for name in SOURCES],
        extra_cflags=["-O3"],  # the C++ standard is torch's choice (C++20 for torch >= 2.10)
        extra_cuda_cflags=["-O3", "-lineinfo"],
        extra_ldflags=[f"-L{lib_dir}"],
        build_directory=str(build_dir),
        verbose=verbose,
    )


@functools.cache
def num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def decode_num_splits(num_seqs: int, num_kv_heads: int, max_context_len: int, num_sms: int) -> int:
    """How many ranges each sequence's context is cut into: enough CTAs to fill the GPU, and at least
    MIN_TOKENS_PER_SPLIT keys per range. Depends only on its arguments (CUDA graphs pass an upper bound)."""
    wanted = -(-DECODE_CTAS_PER_SM * num_sms // max(1, num_seqs * num_kv_heads))
    useful = -(-max(1, max_context_len) // MIN_TOKENS_PER_SPLIT)
    return max(1, min(wanted, useful, MAX_SPLITS))


def supports(head_dim: int, num_heads: int, num_kv_heads: int) -> bool:
    return (
        head_dim in SUPPORTED_HEAD_DIMS
        and num_heads % num_kv_heads == 0
        and num_heads // num_kv_heads <= MAX_GROUP_SIZE
    )


def paged_decode_attention(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    max_context_len: int,
    num_splits: int | None = None,
) -> torch.Tensor:
    """q: [num_seqs, num_heads, head_dim], one token per sequence; returns the same shape in q's dtype."""
    num_seqs, num_heads, head_dim = q.shape
    if num_splits is None:
        num_splits = decode_num_splits(
            num_seqs, k_pool.shape[2], max_context_len, num_sms(q.device.index or 0)
        )
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if num_splits > 1:
        partial_out = torch.empty(
            (num_seqs, num_heads, num_splits, head_dim), dtype=torch.float32, device=q.device
        )
        partial_lse = torch.empty((num_seqs, num_heads, num_splits), dtype=torch.float32, device=q.device)
    else:
        partial_out = partial_lse = torch.empty(0, dtype=torch.float32, device=q.device)
    load().paged_decode_attention(
        out, q, k_pool, v_pool, block_tables, context_lens, scale, num_splits, partial_out, partial_lse
    )
    return out


def paged_prefill_attention(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    positions: torch.Tensor,
    scale: float,
    max_query_len: int,
) -> torch.Tensor:
    """q: [num_tokens, num_heads, head_dim] (sequence i's rows cu_seqlens_q[i]:cu_seqlens_q[i+1])."""
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    load().paged_prefill_attention(
        out, q, k_pool, v_pool, block_tables, context_lens, cu_seqlens_q, positions, scale, max_query_len
    )
    return out


def store_kv(
    k: torch.Tensor, v: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Scatters k, v [num_tokens, num_kv_heads, head_dim] into flat slots `slot_mapping` (< 0: skipped)."""
    load().store_kv(k, v, k_pool, v_pool, slot_mapping)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Returns (rmsnorm(x + residual), x + residual); with residual None, (rmsnorm(x), None)."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1]).contiguous()
    res2 = None if residual is None else residual.reshape(-1, shape[-1]).contiguous()
    out = torch.empty_like(x2)
    residual_out = torch.empty_like(x2) if res2 is not None else out
    load().fused_add_rms_norm(out, residual_out, x2, res2, weight.contiguous(), eps)
    return out.view(shape), (None if res2 is None else residual_out.view(shape))


def rotary_embedding(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor
) -> None:
    """Rotates q [num_tokens, num_heads, head_dim] and k [num_tokens, num_kv_heads, head_dim] in place."""
    load().rotary_embedding(q, k, positions, inv_freq)
