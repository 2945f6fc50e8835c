"""Rill's GPU kernels, all Triton: `GpuOps`, the GPU's `KernelOps`.

Paged attention is `rill.kernels.triton_attention.paged_attention`; the KV write, fused add + RMSNorm, rotary,
SiLU-and-mul, the sampler's row reductions and LoRA's product are `rill.kernels.triton_ops` (contracts at the
top of each file). Linear layers keep torch's GEMM. Nothing is built ahead of time: Triton compiles each
kernel for the device on its first call with a new shape class and caches the binary (~/.triton/cache). CI
executes the same kernels on the CPU under Triton's interpreter and compiles them for sm_80 and sm_90 without
a GPU (docs/kernels.md, "GPU kernels").

Outputs are allocated here with torch and no op syncs with the host, so every op can be captured in a CUDA
graph. This module imports nothing from rill.shard: kernels sit below the shard.
"""

from __future__ import annotations

import functools
import importlib.util
from types import ModuleType

import torch

from rill.kernels.ops import AttentionMetadata, KernelOps, run_fused_add_rms_norm


@functools.cache
def kernels() -> ModuleType:
    """rill.kernels.triton_ops, imported on first use: a CPU shard never imports triton."""
    from rill.kernels import triton_ops

    return triton_ops


@functools.cache
def attention() -> ModuleType:
    """rill.kernels.triton_attention, imported on first use."""
    from rill.kernels import triton_attention

    return triton_attention


class GpuOps(KernelOps):
    """Every required op, and silu_and_mul, the row reductions and lora_add, as Triton kernels; not linear
    (torch's GEMM on a GPU). Tensors may also live on the CPU when Triton runs interpreted
    (`TRITON_INTERPRET=1`), as the tests do."""

    name = "cuda"
    captures_cuda_graphs = True

    def unavailable_reason(self) -> str | None:
        if importlib.util.find_spec("triton") is None:
            return "triton is not installed (it comes with torch's CUDA wheels: `pip install triton`)"
        if not torch.cuda.is_available():
            return "no CUDA device for Rill's Triton kernels"
        return None

    def load(self, verbose: bool = False) -> ModuleType:
        """The kernels' module; Triton compiles each kernel on its first call, so nothing is built here."""
        return kernels()

    def attention_unsupported(
        self, head_dim: int, num_heads: int, num_kv_heads: int, sliding_window: int, softcap: float
    ) -> str | None:
        reason = attention().unsupported(head_dim, num_heads, num_kv_heads)
        return None if reason is None else f"the Triton attention kernel cannot run it: {reason}"

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
        """Bitwise the reference; a slot past the pool is skipped like a negative one (checking it would sync
        with the host). No int8 pools (`kv_cache_dtypes`)."""
        _refuse_int8(k_scale, v_scale)
        kernels().launch_store_kv(k, v, k_pool, v_pool, slot_mapping)

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
        _refuse_int8(k_scale, v_scale)
        return attention().paged_attention(q, k_pool, v_pool, meta, scale, sliding_window, softcap)

    def fused_add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The sum bitwise, the output within float32 rounding (the sum of squares' order differs)."""
        return run_fused_add_rms_norm(kernels().launch_fused_add_rms_norm, x, residual, weight, eps)

    def rotary_embedding(
        self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> None:
        """Bitwise the reference: every product and sum rounded where it rounds."""
        kernels().launch_rotary_embedding(q, k, cos, sin)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """Within a few ulp of the reference (the GPU's exp)."""
        x2 = x.reshape(-1, x.shape[-1]).contiguous()
        out = torch.empty((x2.shape[0], x2.shape[1] // 2), dtype=x.dtype, device=x.device)
        kernels().launch_silu_and_mul(out, x2)
        return out.view(*x.shape[:-1], x.shape[-1] // 2)

    def lora_add(
        self,
        y: torch.Tensor,
        x: torch.Tensor,
        lora_a: torch.Tensor,
        lora_b: torch.Tensor,
        row_slots: torch.Tensor,
        part_ends: tuple[int, ...],
    ) -> None:
        """Two kernels (shrink, expand); rounded to the dtype where the reference rounds, summed in another
        order: float32 within rounding of the reference, not bitwise. Up to 3 parts; row_slots int32."""
        kernels().launch_lora_add(y, x.contiguous(), lora_a, lora_b, row_slots, part_ends)

    def argmax_rows(self, x: torch.Tensor) -> torch.Tensor:
        """Bitwise torch's."""
        out = torch.empty(x.shape[0], dtype=torch.int64, device=x.device)
        kernels().launch_argmax_rows(out, x.contiguous())
        return out

    def softmax_stats(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The max bitwise, the log-sum within float32 rounding."""
        row_max = torch.empty(x.shape[0], dtype=torch.float32, device=x.device)
        log_sum = torch.empty_like(row_max)
        kernels().launch_softmax_stats(row_max, log_sum, x.contiguous())
        return row_max, log_sum


def _refuse_int8(k_scale: torch.Tensor | None, v_scale: torch.Tensor | None) -> None:
    if k_scale is not None or v_scale is not None:
        raise ValueError(
            "the Triton kernels have no int8 KV cache: use --kv-cache-dtype auto on cuda, or the CPU"
        )
