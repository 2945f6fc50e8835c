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
"""

from __future__ import annotations

import torch

from rill.kernels import cpu as cpu_kernels
from rill.kernels.ops import KernelOps


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
        """ops: the kernels that read and write the pools, in their layout (None: the torch references')."""
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
        self.device = torch.device(device)
        self.host_k: list[torch.Tensor] = []
        self.host_v: list[torch.Tensor] = []

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
        self.host_k, self.host_v = [], []
        if num_host_blocks < 2:
            return
        pin = self.device.type == "cuda"
        for pool, host in ((self.k, self.host_k), (self.v, self.host_v)):
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
        """Copies device block `device_blocks[i]` into host block `host_blocks[i]`, every layer, K and V."""
        if not device_blocks:
            return
        device_index, host_index = self._block_indices(device_blocks, host_blocks)
        for device_pool, host_pool in ((self.k, self.host_k), (self.v, self.host_v)):
            for device_layer, host_layer in zip(device_pool, host_pool, strict=True):
                host_layer.index_copy_(0, host_index, device_layer.index_select(0, device_index).cpu())

    def swap_in(self, host_blocks: list[int], device_blocks: list[int]) -> None:
        """Copies host block `host_blocks[i]` into device block `device_blocks[i]`, every layer, K and V."""
        if not device_blocks:
            return
        device_index, host_index = self._block_indices(device_blocks, host_blocks)
        for device_pool, host_pool in ((self.k, self.host_k), (self.v, self.host_v)):
            for device_layer, host_layer in zip(device_pool, host_pool, strict=True):
                blocks = host_layer.index_select(0, host_index).to(self.device, non_blocking=True)
                device_layer.index_copy_(0, device_index, blocks)

    @staticmethod
    def bytes_per_block(
        num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> int:
        return 2 * num_layers * block_size * num_kv_heads * head_dim * dtype.itemsize

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.block_size

    def store_kv(self, layer: int, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Scatters k, v of shape [num_tokens, num_kv_heads, head_dim] into the flat slots `slot_mapping` (the
        torch reference; a pool in a kernel layout is written by the kernels' store_kv)."""
        if self.k[layer].shape != self.v[layer].shape:
            raise RuntimeError("this K pool is in the kernels' layout: only their store_kv writes it")
        k_slots = self.k[layer].view(self.num_slots, *self.k[layer].shape[2:])
        v_slots = self.v[layer].view(self.num_slots, *self.v[layer].shape[2:])
        k_slots.index_copy_(0, slot_mapping, k.to(k_slots.dtype))
        v_slots.index_copy_(0, slot_mapping, v.to(v_slots.dtype))
