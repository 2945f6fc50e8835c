"""Token embedding (a row gather, trivially batch-invariant) and the LM head that may share its weight."""

from __future__ import annotations

import torch
from torch import nn

from shard.layers.linear import invariant_matmul


class Embedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size), requires_grad=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.weight[input_ids]


class LMHead(nn.Module):
    """Logits for the given hidden rows, in float32. With tied embeddings, `weight` is the embedding's."""

    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size), requires_grad=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return invariant_matmul(hidden, self.weight).float()
