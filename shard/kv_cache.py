"""The paged KV pool: per layer, K and V blocks of `block_size` slots, indexed by the router's block ids.

Layout per layer: k and v of shape [num_blocks, block_size, num_kv_heads, head_dim]. Position p of a sequence
lives in slot `block_table[p // block_size] * block_size + p % block_size`. The router owns every block (it
allocates, shares and frees them); this pool only stores and reads. Block 0 is the null block: the router
never hands it to a sequence, so anything written there is garbage nobody reads.
"""

from __future__ import annotations

import torch


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
    ) -> None:
        if num_blocks < 2:
            raise ValueError(
                f"the KV pool needs at least 2 blocks (block 0 is the null block), got {num_blocks}"
            )
        self.num_blocks = num_blocks
        self.block_size = block_size
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]

    @staticmethod
    def bytes_per_block(
        num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> int:
        return 2 * num_layers * block_size * num_kv_heads * head_dim * dtype.itemsize

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.block_size

    def store_kv(self, layer: int, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Scatters k, v of shape [num_tokens, num_kv_heads, head_dim] into the flat slots `slot_mapping`."""
        k_slots = self.k[layer].view(self.num_slots, *self.k[layer].shape[2:])
        v_slots = self.v[layer].view(self.num_slots, *self.v[layer].shape[2:])
        k_slots.index_copy_(0, slot_mapping, k.to(k_slots.dtype))
        v_slots.index_copy_(0, slot_mapping, v.to(v_slots.dtype))
