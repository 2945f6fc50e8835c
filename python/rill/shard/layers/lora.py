"""LoRA on a projection: the stacked adapter weights a `Linear` holds, and the torch reference of the product.

A projection y = x W^T with adapters gets, for a row run with adapter a, y += scale_a * (x A_a^T) B_a^T
(PEFT's LoRA: A_a [r, in], B_a [out, r]). The weights of the adapters a forward may use sit in S slots
(`--max-loras`) of one stack per projection, so one call serves a batch that mixes adapters and base rows,
each row picking its slot (`ForwardContext.lora_slots`):

- `a` [S, P * R, in]: slot s holds the A of each of the projection's P parts (q/k/v of a fused qkv, gate/up),
  part p in rows [p * R, (p + 1) * R), zero-padded from the adapter's rank up to R (`--max-lora-rank`);
- `b` [S, out, R]: the B of the part that owns each output row, times the adapter's scaling, zero-padded in
  its columns from the rank up to R. A part the adapter leaves alone is zero in both.

Padding and untouched parts add exact zeros, so a row's bits do not depend on R beyond its rank's terms nor on
which slot holds its adapter. With tensor parallelism the stacks are split as the weight they modify is: B's
rows for a column-parallel projection, A's columns for a row-parallel one (whose partial products the
all-reduce then sums, as it sums the base product's).
"""

from __future__ import annotations

import torch

from rill.kernels.ops import KernelOps
from rill.shard.layers.attention import get_forward_context
from rill.shard.layers.linear import invariant_matmul


class LoraStack:
    """The adapter slots of one projection (see the module docstring), zero until adapters are put in them;
    `Linear.lora` holds it. Adds the product with `ops.lora_add` where the ops provide it, else the
    reference. `a` and `b` are written in place (an adapter copied into its slot), never replaced: the CPU's
    fused decoder stack keeps pointers to them from when it is built."""

    def __init__(
        self,
        num_slots: int,
        rank: int,
        in_features: int,
        part_ends: tuple[int, ...],
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.rank, self.part_ends = rank, part_ends
        self.a = torch.zeros(num_slots, len(part_ends) * rank, in_features, dtype=dtype, device=device)
        self.b = torch.zeros(num_slots, part_ends[-1], rank, dtype=dtype, device=device)
        self.ops: KernelOps | None = None

    def use_ops(self, ops: KernelOps | None) -> None:
        self.ops = ops if ops is not None and ops.provides("lora_add") else None

    def add(self, y: torch.Tensor, x: torch.Tensor) -> None:
        """y += each row's adapter product, for the rows of this forward's `lora_slots` (none: nothing)."""
        slots = get_forward_context().lora_slots
        if slots is None:
            return
        lora_add = self.ops.lora_add if self.ops is not None else lora_add_reference
        lora_add(y, x, self.a, self.b, slots, self.part_ends)


def lora_add_reference(
    y: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    row_slots: torch.Tensor,
    part_ends: tuple[int, ...],
) -> None:
    """`KernelOps.lora_add` in torch: the rows of each slot gathered, shrunk by A, expanded by each part's B
    and added to y in place. Row r depends only on row r (`invariant_matmul`)."""
    rank = lora_b.shape[2]
    for slot in sorted(set(row_slots.tolist()) - {-1}):
        rows = (row_slots == slot).nonzero().squeeze(1)
        h = invariant_matmul(x[rows], lora_a[slot])
        start = 0
        for part, end in enumerate(part_ends):
            product = invariant_matmul(h[:, part * rank : (part + 1) * rank], lora_b[slot, start:end])
            y[rows, start:end] += product
            start = end
