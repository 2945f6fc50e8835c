"""The one kernel interface: every device's kernels implement `KernelOps`, with one signature per op.

A layer of the shard holds a `KernelOps` (or None, meaning its plain-torch reference, the oracle every kernel
is tested against) and never asks which device answers. The runner picks the ops once per model
(`--attention-backend`), builds one `AttentionMetadata` per forward whatever the ops, and hands the ops to
each layer that can run on them. The implementations: `rill.kernels.cpu.CpuOps` (C++, OpenMP, AVX-512) and
`rill.kernels.gpu.GpuOps` (Triton); a new backend (quantized, another GPU) subclasses `KernelOps` here.

Required ops are abstract. Optional ones (`silu_and_mul`, the packed `linear`, the sampler's row reductions)
raise in this base class; `provides(name)` says whether a backend overrides one, and a layer whose op is not
provided keeps its torch reference. Every op computes what its reference computes (the layer modules of
rill.shard.layers state it); each implementation's docstring says where its rounding differs, if anywhere.
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from rill.kernels.quant import QuantizedTensor


@dataclass(frozen=True)
class AttentionMetadata:
    """Where the tokens of one forward pass go and what they attend to, for every backend.

    Sequence i owns query rows [cu_seqlens_q[i], cu_seqlens_q[i+1]) of the flattened batch and attends to its
    positions [0, context_lens[i]) through block_tables[i] (padded with the null block 0). Tensors live on the
    model's device; for a CUDA graph they are views of its static buffers. `max_query_len` and
    `max_context_len` are upper bounds (a graph passes its capture bounds)."""

    block_tables: torch.Tensor  # int64 [num_seqs, max_blocks_per_seq]
    slot_mapping: torch.Tensor  # int64 [num_tokens]: the flat pool slot of each new token's K/V (< 0: none)
    positions: torch.Tensor  # int64 [num_tokens]
    cu_seqlens_q: torch.Tensor  # int32 [num_seqs + 1]
    context_lens: torch.Tensor  # int32 [num_seqs]
    max_query_len: int
    max_context_len: int

    @property
    def is_decode(self) -> bool:
        """Every sequence computes exactly one token."""
        return self.max_query_len == 1

    @classmethod
    def build(
        cls,
        cu_seqlens_q: list[int],
        context_lens: list[int],
        block_tables: torch.Tensor,
        slot_mapping: torch.Tensor,
        positions: torch.Tensor,
    ) -> AttentionMetadata:
        """From the host lists of a batch (the tensors already on the model's device)."""
        device = positions.device
        query_lens = [end - start for start, end in zip(cu_seqlens_q, cu_seqlens_q[1:], strict=False)]
        return cls(
            block_tables=block_tables,
            slot_mapping=slot_mapping,
            positions=positions,
            cu_seqlens_q=torch.tensor(cu_seqlens_q, dtype=torch.int32, device=device),
            context_lens=torch.tensor(context_lens, dtype=torch.int32, device=device),
            max_query_len=max(query_lens, default=0),
            max_context_len=max(context_lens, default=0),
        )


class KernelOps(abc.ABC):
    """One device's kernels. Tensors are on that device, in the model's dtype unless an op says otherwise."""

    name: str  # for logs: "cpu", "cuda"
    captures_cuda_graphs: bool = False  # its ops never sync with the host nor allocate host memory
    # --kv-cache-dtype values its store_kv and paged_attention take: auto (pools of the model's dtype) and,
    # where listed, int8 (int8 pools with float32 scale pools, passed as k_scale / v_scale)
    kv_cache_dtypes: tuple[str, ...] = ("auto",)

    # --- building ---

    @abc.abstractmethod
    def unavailable_reason(self) -> str | None:
        """Why these kernels cannot be built or loaded here (None: they can), cheaply, without building."""

    @abc.abstractmethod
    def load(self, verbose: bool = False) -> ModuleType:
        """Builds (once per machine, cached) or loads the compiled library; raises RuntimeError/OSError when
        the build fails."""

    # --- what a model may ask of them ---

    def attention_unsupported(
        self, head_dim: int, num_heads: int, num_kv_heads: int, sliding_window: int, softcap: float
    ) -> str | None:
        """Why `paged_attention` cannot serve a layer of this shape (None: it can)."""
        return None

    def k_pool_shape(
        self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> tuple[int, ...]:
        """The shape of a layer's K pool in these kernels' layout; V pools are always [num_blocks, block_size,
        num_kv_heads, head_dim], and so is K unless a backend says otherwise."""
        return (num_blocks, block_size, num_kv_heads, head_dim)

    def provides(self, op: str) -> bool:
        """Whether this backend implements the optional op `op` (it overrides the base class's)."""
        return getattr(type(self), op) is not getattr(KernelOps, op)

    # --- required ops ---

    @abc.abstractmethod
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
        """Writes k, v [num_tokens, num_kv_heads, head_dim] into flat slots `slot_mapping` (< 0: skipped) of
        one layer's pools (K in `k_pool_shape`), converting to the pools' dtype. int8 pools (k_scale, v_scale
        float32 [num_blocks, block_size, num_kv_heads] given): each row quantized as
        `rill.shard.kv_cache.quantize_int8` does, bitwise, its scale into the scale pool."""

    @abc.abstractmethod
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
        """Causal attention of every query row q [num_tokens, num_heads, head_dim] through the paged pools,
        for the whole batch in one call; int8 pools are read with their scale pools (as for `store_kv`). A
        query at position p sees its sequence's keys 0..p (with
        sliding_window > 0 only those > p - sliding_window, and keys before that window are never read); with
        softcap > 0, scores become softcap * tanh(score / softcap). Query head h reads KV head h // (num_heads
        / num_kv_heads). Returns [num_tokens, num_heads, head_dim] in q's dtype."""

    @abc.abstractmethod
    def fused_add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(rmsnorm(x + residual) * weight, x + residual), or (rmsnorm(x) * weight, None) without a residual;
        the sum rounded to x's dtype, the norm in float32. weight has x's dtype."""

    @abc.abstractmethod
    def rotary_embedding(
        self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> None:
        """Rotates q [num_tokens, num_heads, head_dim] and k [num_tokens, num_kv_heads, head_dim] in place
        (rotate-half) by cos, sin [num_tokens, head_dim / 2] in q's dtype (the caller's table, any attention
        factor included)."""

    # --- optional ops (see `provides`) ---

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """x [num_tokens, 2 * I] -> silu(x[:, :I]) * x[:, I:] in x's dtype."""
        raise NotImplementedError(f"the {self.name} kernels have no silu_and_mul")

    def pack_linear(self, weight: torch.Tensor) -> torch.Tensor:
        """A weight [out, in] in the layout `linear` reads, packed once after loading (the weight itself where
        the kernels multiply it as it is)."""
        raise NotImplementedError(f"the {self.name} kernels have no linear")

    def linear(self, x: torch.Tensor, packed: torch.Tensor, out_features: int) -> torch.Tensor:
        """x [rows, in] @ weight^T with the weight from `pack_linear`; row r depends only on row r of x."""
        raise NotImplementedError(f"the {self.name} kernels have no linear")

    def pack_quantized(self, parts: list[QuantizedTensor]) -> torch.Tensor:
        """A quantized weight (its parts in row order, `rill.kernels.quant.QuantizedTensor`s, up to four,
        one K) in the layout `linear` and `dequantize_rows` read: `linear` then multiplies it as it is."""
        raise NotImplementedError(f"the {self.name} kernels have no quantized weights")

    def dequantize_rows(self, packed: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` of a weight from `pack_quantized`, de-quantized to float32 [len(ids), in] (an embedding
        lookup), bitwise as `rill.kernels.quant.dequantize` gives them."""
        raise NotImplementedError(f"the {self.name} kernels have no quantized weights")

    def lora_add(
        self,
        y: torch.Tensor,
        x: torch.Tensor,
        lora_a: torch.Tensor,
        lora_b: torch.Tensor,
        row_slots: torch.Tensor,
        part_ends: tuple[int, ...],
    ) -> None:
        """Adds each row's LoRA product to y [rows, out] in place (`rill.shard.layers.lora.lora_add_reference`
        states the math): for row r whose slot s = row_slots[r] (int32 [rows]) is >= 0, h = lora_a[s] @ x[r]
        with lora_a [S, P * R, in], then y[r, o] += lora_b[s, o] . h[p * R : (p + 1) * R] for the outputs o of
        part p, [part_ends[p - 1], part_ends[p]) (part_ends[-1] = out), with lora_b [S, out, R] (the adapter's
        scaling folded in). Rows whose slot is -1 are not touched. Row r's bits depend only on row r of x and
        y and on its slot's weights: not on the other rows, nor on which slot holds those weights."""
        raise NotImplementedError(f"the {self.name} kernels have no lora_add")

    def argmax_rows(self, x: torch.Tensor) -> torch.Tensor:
        """The index of each row's first maximum (a NaN counts as the maximum), int64 [rows], for float32
        x [rows, n]: torch's `x.max(dim=-1).indices`."""
        raise NotImplementedError(f"the {self.name} kernels have no argmax_rows")

    def softmax_stats(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's max and log(sum(exp(x - max))), float32 [rows] each, for float32 x [rows, n]."""
        raise NotImplementedError(f"the {self.name} kernels have no softmax_stats")


def run_fused_add_rms_norm(
    kernel: Callable[..., None],
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`KernelOps.fused_add_rms_norm` through a compiled `kernel(out, residual_out, x, residual, weight, eps)`
    over rows [num_rows, hidden], which every backend's binding has: flattens, allocates the outputs, reshapes
    back."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1]).contiguous()
    res2 = None if residual is None else residual.reshape(-1, shape[-1]).contiguous()
    out = torch.empty_like(x2)
    residual_out = torch.empty_like(x2) if res2 is not None else out
    kernel(out, residual_out, x2, res2, weight.contiguous(), eps)
    return out.view(shape), (None if res2 is None else residual_out.view(shape))
