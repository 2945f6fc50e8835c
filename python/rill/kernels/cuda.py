"""Rill's CUDA kernels (CUDA C++, rill/kernels/csrc/*.cu): `CudaOps`, the GPU's `KernelOps`.

The sources are compiled (rill.kernels.extension) into ~/.cache/rill/kernels/cuda-<hash> on first use; the
hash covers the sources, torch's version and the target archs. `python -m rill.kernels.build` builds ahead of
time. nvcc comes from the CUDA toolkit on PATH / CUDA_HOME, or from the PyPI wheels (`pip install
"rill[cuda]"`).

Outputs are allocated here with torch and no op syncs with the host, so every op can be captured in a CUDA
graph. Paged attention runs one of two kernels: decode (one query per sequence, the context split into ranges
whose count depends on the batch, so not batch-invariant) or prefill (any chunks over their cached prefix).
"""

from __future__ import annotations

import functools
import os
import shutil
from pathlib import Path
from types import ModuleType

import torch

from rill.kernels.extension import KernelSources, load_extension
from rill.kernels.ops import AttentionMetadata, KernelOps, run_fused_add_rms_norm

CSRC = Path(__file__).resolve().parent / "csrc"
SOURCES = ("binding.cpp", "attention.cu", "cache.cu", "norm_rotary.cu")
HEADERS = ("common.cuh", "ops.h", "torch_checks.h")
SUPPORTED_HEAD_DIMS = (64, 128)
MAX_GROUP_SIZE = 16  # query heads per KV head; kMaxGroupSize in ops.h
# Decode split heuristic: aim for this many CTAs per SM, never fewer than this many keys per split.
DECODE_CTAS_PER_SM = 8
MIN_TOKENS_PER_SPLIT = 256
MAX_SPLITS = 64


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


def _arch_list() -> str:
    if os.environ.get("TORCH_CUDA_ARCH_LIST"):
        return os.environ["TORCH_CUDA_ARCH_LIST"]
    archs = sorted({torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())})
    return ";".join(f"{major}.{minor}" for major, minor in archs)


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
    lib_dir = cuda_home / "lib64" if (cuda_home / "lib64").is_dir() else cuda_home / "lib"
    sources = KernelSources(
        prefix="cuda",
        directory=CSRC,
        sources=SOURCES,
        headers=HEADERS,
        cflags=("-O3",),  # the C++ standard is torch's choice (C++20 for torch >= 2.10)
        cuda_cflags=("-O3", "-lineinfo"),
        ldflags=(f"-L{lib_dir}",),
        machine=arch_list,
    )
    return load_extension(sources, verbose)


@functools.cache
def num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def decode_num_splits(num_seqs: int, num_kv_heads: int, max_context_len: int, num_sms: int) -> int:
    """How many ranges each sequence's context is cut into: enough CTAs to fill the GPU, and at least
    MIN_TOKENS_PER_SPLIT keys per range. Depends only on its arguments (CUDA graphs pass an upper bound)."""
    wanted = -(-DECODE_CTAS_PER_SM * num_sms // max(1, num_seqs * num_kv_heads))
    useful = -(-max(1, max_context_len) // MIN_TOKENS_PER_SPLIT)
    return max(1, min(wanted, useful, MAX_SPLITS))


class CudaOps(KernelOps):
    """The required ops on a CUDA GPU; the optional ones stay torch's (its GEMMs and elementwise ops)."""

    name = "cuda"
    captures_cuda_graphs = True

    def unavailable_reason(self) -> str | None:
        if find_cuda_home() is None:
            return "nvcc not found: install the CUDA toolkit or `pip install 'rill[cuda]'`"
        return None

    def load(self, verbose: bool = False) -> ModuleType:
        return load(verbose)

    def attention_unsupported(
        self, head_dim: int, num_heads: int, num_kv_heads: int, sliding_window: int, softcap: float
    ) -> str | None:
        if sliding_window or softcap:
            return "the CUDA attention kernels have no sliding window or soft-capping"
        if head_dim not in SUPPORTED_HEAD_DIMS or num_heads // num_kv_heads > MAX_GROUP_SIZE:
            return (
                f"the CUDA kernels support head_dim {SUPPORTED_HEAD_DIMS} and at most {MAX_GROUP_SIZE} query "
                f"heads per KV head, not head_dim {head_dim} with {num_heads} heads / {num_kv_heads} KV heads"
            )
        return None

    def store_kv(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        k_pool: torch.Tensor,
        v_pool: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        load().store_kv(k.to(k_pool.dtype), v.to(v_pool.dtype), k_pool, v_pool, slot_mapping)

    def paged_attention(
        self,
        q: torch.Tensor,
        k_pool: torch.Tensor,
        v_pool: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        sliding_window: int = 0,
        softcap: float = 0.0,
    ) -> torch.Tensor:
        if sliding_window or softcap:
            raise ValueError("the CUDA attention kernels have no sliding window or soft-capping")
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        if meta.is_decode:
            self._decode(out, q, k_pool, v_pool, meta, scale)
        else:
            load().paged_prefill_attention(
                out,
                q,
                k_pool,
                v_pool,
                meta.block_tables,
                meta.context_lens,
                meta.cu_seqlens_q,
                meta.positions,
                scale,
                meta.max_query_len,
            )
        return out

    def _decode(
        self,
        out: torch.Tensor,
        q: torch.Tensor,
        k_pool: torch.Tensor,
        v_pool: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> None:
        num_seqs, num_heads, head_dim = q.shape
        num_splits = decode_num_splits(
            num_seqs, k_pool.shape[2], meta.max_context_len, num_sms(q.device.index or 0)
        )
        if num_splits > 1:
            partial_out = torch.empty(
                (num_seqs, num_heads, num_splits, head_dim), dtype=torch.float32, device=q.device
            )
            partial_lse = torch.empty((num_seqs, num_heads, num_splits), dtype=torch.float32, device=q.device)
        else:
            partial_out = partial_lse = torch.empty(0, dtype=torch.float32, device=q.device)
        load().paged_decode_attention(
            out,
            q,
            k_pool,
            v_pool,
            meta.block_tables,
            meta.context_lens,
            scale,
            num_splits,
            partial_out,
            partial_lse,
        )

    def fused_add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        return run_fused_add_rms_norm(load().fused_add_rms_norm, x, residual, weight, eps)

    def rotary_embedding(
        self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> None:
        load().rotary_embedding(q, k, cos.contiguous(), sin.contiguous())
