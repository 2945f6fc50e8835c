"""Mixture-of-experts feed-forward (Mixtral, Qwen3-MoE): a router picks each token's top-k experts, and
each expert is a SiLU-gated MLP; the token's output is the routing-weighted sum of its experts' outputs.

Experts are batched: one pass per expert over the tokens routed to it (a loop over experts, never over
tokens). Every matmul goes through `invariant_matmul`, and a token's expert outputs are added in expert
order, so a token's result does not depend on which other tokens share the call (batched == alone, bitwise).

Tensor parallelism: every expert's intermediate features are split across ranks (column-parallel gate/up,
row-parallel down, as a dense MLP), and the partial sums of all experts are all-reduced once. The router
is replicated, so every rank routes every token the same way.

Checkpoint names: `experts.{e}.{w1|w3|w2}` (Mixtral) or `experts.{e}.{gate_proj|up_proj|down_proj}` (Qwen)
map to the stacked parameters through `expert_checkpoint_name`.
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn

from rill.shard import distributed
from rill.shard.layers.linear import Linear, copy_into, divide, invariant_matmul, read_part

_EXPERT_TENSOR = re.compile(r"\.experts\.(\d+)\.(w1|w2|w3|gate_proj|up_proj|down_proj)\.weight$")
_PART = {"w1": "gate", "gate_proj": "gate", "w3": "up", "up_proj": "up", "w2": "down", "down_proj": "down"}


def expert_checkpoint_name(name: str) -> tuple[str, tuple[int, str]] | None:
    """`...experts.3.w1.weight` -> (`...experts.w13_weight`, (3, "gate")); None for other tensors."""
    match = _EXPERT_TENSOR.search(name)
    if match is None:
        return None
    part = _PART[match.group(2)]
    stacked = "w2_weight" if part == "down" else "w13_weight"
    return name[: match.start()] + f".experts.{stacked}", (int(match.group(1)), part)


class Experts(nn.Module):
    """`num_experts` SiLU-gated MLPs, stacked: w13 [experts, 2 * inter/N, hidden] (gate rows, then up
    rows), w2 [experts, hidden, inter/N]. `forward` returns this rank's partial sum (not all-reduced)."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.tp_rank = distributed.get_rank()
        self.local_size = divide(intermediate_size, distributed.get_world_size(), "moe_intermediate_size")
        self.w13_weight = nn.Parameter(
            torch.empty(num_experts, 2 * self.local_size, hidden_size), requires_grad=False
        )
        self.w2_weight = nn.Parameter(
            torch.empty(num_experts, hidden_size, self.local_size), requires_grad=False
        )
        self.w13_weight.weight_loader = self.weight_loader
        self.w2_weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: Any, shard_id: object = None) -> None:
        expert, part = shard_id  # type: ignore[misc]
        size, start = self.local_size, self.tp_rank * self.local_size
        if part == "down":
            copy_into(param.data[expert], read_part(loaded, 1, start, size))
        else:
            offset = 0 if part == "gate" else size
            copy_into(param.data[expert, offset : offset + size], read_part(loaded, 0, start, size))

    def forward(self, hidden: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """hidden [tokens, hidden]; weights, experts [tokens, top_k] -> [tokens, hidden] partial sums."""
        out = torch.zeros_like(hidden)
        for expert in torch.unique(experts).tolist():
            token_ids, slots = (experts == expert).nonzero(as_tuple=True)
            gate, up = invariant_matmul(hidden[token_ids], self.w13_weight[expert]).split(
                self.local_size, dim=-1
            )
            expert_out = invariant_matmul(nn.functional.silu(gate) * up, self.w2_weight[expert])
            out.index_add_(0, token_ids, expert_out * weights[token_ids, slots, None])
        return out


class SparseMoE(nn.Module):
    """Router (`gate`, replicated) + experts. `normalize_top_k`: the top-k routing probabilities are
    rescaled to sum to 1 (Mixtral always, Qwen3-MoE when `norm_topk_prob`)."""

    def __init__(
        self, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int, normalize_top_k: bool
    ) -> None:
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok ({top_k}) must be in [1, num_experts ({num_experts})]")
        self.top_k = top_k
        self.normalize_top_k = normalize_top_k
        self.gate = Linear(hidden_size, num_experts)
        self.experts = Experts(num_experts, hidden_size, intermediate_size)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        probs = torch.softmax(self.gate(hidden).float(), dim=-1)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.normalize_top_k:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return distributed.all_reduce(self.experts(hidden, weights.to(hidden.dtype), experts))
