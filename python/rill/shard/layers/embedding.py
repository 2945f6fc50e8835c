"""Vocab-parallel token embedding and LM head (the head may share the embedding's weight).

The vocabulary is split into N equal ranges of `ceil(vocab / N)` rows (the last range padded with zero
rows past the vocabulary); rank r holds rows [r * rows_per_rank, (r + 1) * rows_per_rank).
- Embedding: each rank looks up the ids in its range and writes zeros for the others; the all-reduce then
  adds exactly one non-zero row per token, so the result is exact (a row gather, trivially batch-invariant).
- LM head: each rank computes the logits of its range; they are gathered along the vocabulary in rank order
  and cut to the vocabulary size, so every rank holds the full logits and samples the same tokens.

A quantized matrix (`load_quantized`, one rank only) stays in its file type: the embedding de-quantizes the
rows it looks up (`KernelOps.dequantize_rows`), and the head multiplies it as `Linear` does; a tied head
shares the embedding's packed matrix.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from rill.kernels.ops import KernelOps
from rill.kernels.quant import QuantizedTensor, dequantize
from rill.shard import distributed
from rill.shard.layers.backend import KernelLayer
from rill.shard.layers.linear import (
    PackedWeight,
    copy_into,
    invariant_matmul,
    loaded_shape,
    pack_for,
    read_part,
)


class VocabParallel(KernelLayer):
    """This rank's rows [vocab_start, vocab_start + rows_per_rank) of a [vocab, hidden] matrix."""

    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        tp_rank, tp_size = distributed.get_rank(), distributed.get_world_size()
        self.rows_per_rank = -(-vocab_size // tp_size)
        self.vocab_start = tp_rank * self.rows_per_rank
        # Uninitialised, so untouched: a quantized matrix (`load_quantized`) never fills it, and the loader
        # fills the vocabulary's rows; only the last rank's padding rows are zeroed here.
        weight = torch.empty(self.rows_per_rank, hidden_size)
        weight[max(0, vocab_size - self.vocab_start) :].zero_()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        self.quantized: list[QuantizedTensor] | None = None  # `load_quantized`, until packed
        self.packed: PackedWeight | None = None  # set with kernel ops, after loading

    def load_quantized(self, tensor: QuantizedTensor, shard_id: object = None) -> None:
        if distributed.get_world_size() != 1:
            raise ValueError("quantized weights run on one shard only (--num-shard 1)")
        if tensor.shape != tuple(self.weight.shape):
            raise ValueError(f"quantized vocabulary matrix {tensor.shape} != {tuple(self.weight.shape)}")
        self.quantized = [tensor]

    def weight_loader(self, param: nn.Parameter, loaded: Any, shard_id: object = None) -> None:
        assert shard_id is None, f"unexpected shard id {shard_id!r} for a vocabulary matrix"
        num_rows = loaded_shape(loaded)[0]
        if num_rows != self.vocab_size:
            raise ValueError(f"vocabulary matrix has {num_rows} rows, the config says {self.vocab_size}")
        size = max(0, min(self.rows_per_rank, num_rows - self.vocab_start))
        copy_into(param.data[:size], read_part(loaded, 0, self.vocab_start, size))


class Embedding(VocabParallel):
    def accepts(self, ops: KernelOps) -> bool:
        return ops.provides("dequantize_rows")

    def use_ops(self, ops: KernelOps | None) -> None:
        """A quantized matrix is packed for ops that look rows up in it, else de-quantized once."""
        super().use_ops(ops)
        if self.quantized is None:
            return
        if self.ops is not None:
            self.packed = PackedWeight(self.quantized, self.ops)
            self.weight = None
        else:
            self.weight = nn.Parameter(
                torch.cat([dequantize(p) for p in self.quantized]), requires_grad=False
            )
        self.quantized = None

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return self.ops.dequantize_rows(self.packed.tensor, input_ids.reshape(-1)).view(
                *input_ids.shape, self.packed.in_features
            )
        if distributed.get_world_size() == 1:
            return self.weight[input_ids]
        local_ids = input_ids - self.vocab_start
        outside = (local_ids < 0) | (local_ids >= self.rows_per_rank)
        rows = self.weight[local_ids.masked_fill(outside, 0)].masked_fill(outside.unsqueeze(-1), 0.0)
        return distributed.all_reduce(rows)


class LMHead(VocabParallel):
    """Logits for the given hidden rows, in float32. Tied (`tie_to`), `weight` is the embedding's; on kernel
    ops with `linear` the head multiplies by a packed copy (`PackedWeight`) and an untied head keeps only
    that."""

    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__(vocab_size, hidden_size)
        self.tied_to: Embedding | None = None

    @property
    def is_tied(self) -> bool:
        return self.tied_to is not None

    def tie_to(self, embedding: Embedding) -> None:
        self.weight = embedding.weight
        object.__setattr__(self, "tied_to", embedding)  # a plain reference, not a submodule of the head

    def accepts(self, ops: KernelOps) -> bool:
        return ops.provides("linear")

    def use_ops(self, ops: KernelOps | None) -> None:
        """Tied, the head reads the embedding's matrix as the embedding holds it after its own `use_ops`
        (which `install_ops` runs first: the embedding comes first in the model): its quantized packed matrix,
        or its (possibly de-quantized) weight. A GGUF file may store the head apart even for a tied model
        (llama.cpp's converter writes `output.weight`, often in a finer type): then the head multiplies its
        own quantized matrix, as llama.cpp does."""
        super().use_ops(ops)
        if self.tied_to is not None and self.quantized is None:
            assert self.tied_to.quantized is None, "the embedding installs its ops before the head"
            if self.ops is not None and self.tied_to.packed is not None:
                self.packed, self.weight = self.tied_to.packed, None
                return
            self.weight = self.tied_to.weight
        self.packed = pack_for(self, keep_weight=self.is_tied)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.packed is None:
            logits = invariant_matmul(hidden, self.weight)
        else:
            logits = self.packed.matmul(hidden)
        return distributed.all_gather_cat(logits.float(), dim=-1)[:, : self.vocab_size]
