"""The paged KV pool: per layer, K and V blocks of `block_size` slots, indexed by the router's block ids.

Layout per layer: k and v of shape [num_blocks, block_size, num_kv_heads, head_dim]; a pool for kernel ops
keeps k in their layout instead (`KernelOps.k_pool_shape`; the CPU's bfloat16 K in pairs of dims), and only
the kernels read and write it. Position p of a sequence lives in slot `block_table[p // block_size] *
block_size + p % block_size`. The router owns every block (it allocates, shares and frees them); this pool
only stores and reads. Block 0 is the null block: the router never hands it to a sequence, so anything written
there is garbage nobody reads.

The swap pool (optional, `allocate_host_pool`) mirrors that layout in host memory (pinned on CUDA, so copies
run at full PCIe speed): the router preempts a sequence by having its blocks copied out to host blocks, and
resumes it by having them copied back into free device blocks. Host block 0 is unused, like device block 0.

An int8 pool (`dtype` torch.int8, `--kv-cache-dtype int8`) holds each K and V row of one (slot, KV head)
quantized, with its own float32 scale in the scale pools `k_scale` / `v_scale` [num_blocks, block_size,
num_kv_heads]: scale = amax(|x|) / 127 over head_dim, q = round-half-even(x / scale) (a row of zeros: scale 0,
q 0), so x ~ q * scale. `quantize_int8` is the reference every kernel's store matches bitwise; readers
dequantize (`dequantize_int8`, or the kernels on the fly). The swap pool copies the scales with the rows.
"""

from __future__ import annotations

import torch

from rill.kernels import cpu as cpu_kernels
from rill.kernels.ops import KernelOps


def quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., head_dim] -> (int8 rows [..., head_dim], float32 scales [...]): per row, scale = amax(|x|) /
    127 and q = round-half-even(x / scale) in float32 (clamped to [-127, 127], which only a subnormal scale
    can leave), q = 0 where scale is 0. The CPU kernels' store_kv does these float32 operations in this
    order."""
    x = x.float()
    scale = x.abs().amax(dim=-1) / 127
    divisor = scale.unsqueeze(-1)
    q = torch.where(divisor > 0, torch.round(x / divisor).clamp(-127, 127), torch.zeros_like(x))
    return q.to(torch.int8), scale


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """float32 rows q * scale (q int8 [..., head_dim], scale float32 [...])."""
    return q.float() * scale.unsqueeze(-1)


class KVCache:
    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        ops: KernelOps | None = None,
    ) -> None:
        """dtype: the pools' (the model's, or torch.int8 for quantized pools with scale pools); ops: the
        kernels that read and write the pools, in their layout (None: the torch references')."""
        if num_blocks < 2:
            raise ValueError(
                f"the KV pool needs at least 2 blocks (block 0 is the null block), got {num_blocks}"
            )
        self.num_blocks = num_blocks
        self.block_size = block_size
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        k_shape = shape if ops is None else ops.k_pool_shape(*shape, dtype)
        self.k = [self._zeros(k_shape, dtype, device) for _ in range(num_layers)]
        self.v = [self._zeros(shape, dtype, device) for _ in range(num_layers)]
        # int8 pools only: the float32 scale of each (slot, KV head) row, [num_blocks, block_size,
        # num_kv_heads].
        num_scale_layers = num_layers if dtype == torch.int8 else 0
        self.k_scale = [self._zeros(shape[:3], torch.float32, device) for _ in range(num_scale_layers)]
        self.v_scale = [self._zeros(shape[:3], torch.float32, device) for _ in range(num_scale_layers)]
        self.device = torch.device(device)
        self.host_k: list[torch.Tensor] = []
        self.host_v: list[torch.Tensor] = []
        self.host_k_scale: list[torch.Tensor] = []
        self.host_v_scale: list[torch.Tensor] = []

    @property
    def is_int8(self) -> bool:
        """The pools hold int8 rows with float32 scales."""
        return bool(self.k_scale)

    def scales(self, layer: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Layer `layer`'s K and V scale pools; (None, None) for pools of the model's dtype."""
        if not self.is_int8:
            return None, None
        return self.k_scale[layer], self.v_scale[layer]

    def pool_pairs(self) -> list[tuple[list[torch.Tensor], list[torch.Tensor]]]:
        """(device pools, host pools) of everything a block holds: K, V and, int8, their scales."""
        pairs = [(self.k, self.host_k), (self.v, self.host_v)]
        if self.is_int8:
            pairs += [(self.k_scale, self.host_k_scale), (self.v_scale, self.host_v_scale)]
        return pairs

    @staticmethod
    def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A pool layer; on the CPU in huge pages (a decode step streams all of it), touched now so the step
        does not page-fault."""
        if torch.device(device).type == "cpu":
            return cpu_kernels.empty_huge_pages(shape, dtype).zero_()
        return torch.zeros(shape, dtype=dtype, device=device)

    @property
    def num_host_blocks(self) -> int:
        """Blocks of the swap pool, null block 0 included; 0 without one."""
        return self.host_k[0].shape[0] if self.host_k else 0

    def allocate_host_pool(self, num_host_blocks: int) -> None:
        """Allocates the swap pool: `num_host_blocks` host blocks (0 = none) laid out as the device blocks."""
        for _, host in self.pool_pairs():
            host.clear()
        if num_host_blocks < 2:
            return
        pin = self.device.type == "cuda"
        for pool, host in self.pool_pairs():
            for layer in pool:
                # Uninitialized: the router only reads host blocks it had written, and untouched pages of
                # a large pool cost nothing on the CPU.
                shape = (num_host_blocks, *layer.shape[1:])
                host.append(torch.empty(shape, dtype=layer.dtype, pin_memory=pin))

    def _block_indices(
        self, device_blocks: list[int], host_blocks: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if len(device_blocks) != len(host_blocks):
            raise ValueError("swap: device and host block lists differ in length")
        bad_device = [b for b in device_blocks if not 0 < b < self.num_blocks]
        if bad_device:
            raise ValueError(f"swap: device blocks {bad_device[:5]} out of range [1, {self.num_blocks})")
        bad_host = [b for b in host_blocks if not 0 < b < self.num_host_blocks]
        if bad_host:
            raise ValueError(f"swap: host blocks {bad_host[:5]} out of range [1, {self.num_host_blocks})")
        device_index = torch.tensor(device_blocks, dtype=torch.int64, device=self.device)
        host_index = torch.tensor(host_blocks, dtype=torch.int64)
        return device_index, host_index

    def swap_out(self, device_blocks: list[int], host_blocks: list[int]) -> None:
        """Copies device block `device_blocks[i]` into host block `host_blocks[i]`, every layer, K and V (and
        their scales)."""
        if not device_blocks:
            return
        device_index, host_index = self._block_indices(device_blocks, host_blocks)
        for device_pool, host_pool in self.pool_pairs():
            for device_layer, host_layer in zip(device_pool, host_pool, strict=True):
                host_layer.index_copy_(0, host_index, device_layer.index_select(0, device_index).cpu())

    def swap_in(self, host_blocks: list[int], device_blocks: list[int]) -> None:
        """Copies host block `host_blocks[i]` into device block `device_blocks[i]`, every layer, K and V (and
        their scales)."""
        if not device_blocks:
            return
        device_index, host_index = self._block_indices(device_blocks, host_blocks)
        for device_pool, host_pool in self.pool_pairs():
            for device_layer, host_layer in zip(device_pool, host_pool, strict=True):
                blocks = host_layer.index_select(0, host_index).to(self.device, non_blocking=True)
                device_layer.index_copy_(0, device_index, blocks)

    @staticmethod
    def bytes_per_block(
        num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> int:
        """K and V of every layer; an int8 pool's rows also carry a float32 scale per (slot, KV head)."""
        row_bytes = head_dim * dtype.itemsize + (torch.float32.itemsize if dtype == torch.int8 else 0)
        return 2 * num_layers * block_size * num_kv_heads * row_bytes

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.block_size

    def store_kv(self, layer: int, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Scatters k, v of shape [num_tokens, num_kv_heads, head_dim] into the flat slots `slot_mapping` (the
        torch reference; a pool in a kernel layout is written by the kernels' store_kv). int8 pools: quantized
        by `quantize_int8`, the scales into the scale pools."""
        if self.k[layer].shape != self.v[layer].shape:
            raise RuntimeError("this K pool is in the kernels' layout: only their store_kv writes it")
        k_slots = self.k[layer].view(self.num_slots, *self.k[layer].shape[2:])
        v_slots = self.v[layer].view(self.num_slots, *self.v[layer].shape[2:])
        if not self.is_int8:
            k_slots.index_copy_(0, slot_mapping, k.to(k_slots.dtype))
            v_slots.index_copy_(0, slot_mapping, v.to(v_slots.dtype))
            return
        for rows, slots, scales in ((k, k_slots, self.k_scale[layer]), (v, v_slots, self.v_scale[layer])):
            q, scale = quantize_int8(rows)
            slots.index_copy_(0, slot_mapping, q)
            scales.view(self.num_slots, -1).index_copy_(0, slot_mapping, scale)

    def rows(self, layer: int, blocks: torch.Tensor, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The first `num_tokens` K and V rows [num_tokens, num_kv_heads, head_dim] of the sequence whose
        blocks are `blocks` (the torch reference's read; pools in rows): as stored, or dequantized to float32
        from an int8 pool."""
        k = self.k[layer][blocks].flatten(0, 1)[:num_tokens]
        v = self.v[layer][blocks].flatten(0, 1)[:num_tokens]
        if not self.is_int8:
            return k, v
        k_scale = self.k_scale[layer][blocks].flatten(0, 1)[:num_tokens]
        v_scale = self.v_scale[layer][blocks].flatten(0, 1)[:num_tokens]
        return dequantize_int8(k, k_scale), dequantize_int8(v, v_scale)
