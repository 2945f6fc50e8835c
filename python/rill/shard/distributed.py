"""The tensor-parallel group: this process's rank and the group size, and the two collectives layers use.

One process per rank; `init` is called once per process, before the model is built, and every layer reads
`get_rank()`/`get_world_size()` at construction. With world size 1 nothing is initialized and every collective
is the identity, so a single shard never touches torch.distributed. Models never import this module: the
parallel layers in `rill.shard.layers` do.

Invariant (batch invariance and rank agreement): `all_reduce` gathers every rank's partial tensor and adds
them in rank order, instead of calling the backend's all-reduce, whose summation order depends on the
algorithm the backend picks for the tensor's size (and so on the batch) and may differ between ranks. Each
element's sum is then ((p0 + p1) + p2) + ... on every rank, whatever the batch, so all ranks hold
bitwise-identical activations and sample identical tokens.
"""

from __future__ import annotations

import logging
from datetime import timedelta

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

# A collective waits this long for a peer that is alive but silent; a peer that died is noticed at once
# (its connection closes) and the collective raises.
COLLECTIVE_TIMEOUT = timedelta(minutes=5)

_rank = 0
_world_size = 1


def init(rank: int, world_size: int, init_method: str | None, device: torch.device) -> None:
    """Joins the group of `world_size` ranks (NCCL on CUDA, gloo on the CPU) through `init_method`
    (a torch.distributed URL: tcp://host:port or file:///path). World size 1: no group, nothing to join."""
    global _rank, _world_size
    if world_size == 1:
        _rank, _world_size = 0, 1
        return
    if dist.is_initialized():
        if (dist.get_rank(), dist.get_world_size()) != (rank, world_size):
            raise RuntimeError(
                f"process group already initialized as rank {dist.get_rank()}/{dist.get_world_size()}"
            )
    else:
        if not init_method:
            raise ValueError(f"world size {world_size} needs an init method (tcp://... or file://...)")
        backend = "nccl" if device.type == "cuda" else "gloo"
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group(
            backend, init_method=init_method, rank=rank, world_size=world_size, timeout=COLLECTIVE_TIMEOUT
        )
        logger.info("rank %d/%d joined the %s group via %s", rank, world_size, backend, init_method)
    _rank, _world_size = rank, world_size


def shutdown() -> None:
    """Leaves the group, if any. A process that exits still in a gloo group can abort on the way out
    ("terminate called without an active exception": the group's threads are torn down unjoined)."""
    if dist.is_initialized():
        dist.destroy_process_group()


def get_rank() -> int:
    return _rank


def get_world_size() -> int:
    return _world_size


def all_gather(x: torch.Tensor) -> list[torch.Tensor]:
    """Every rank's `x` (same shape on every rank), in rank order."""
    if _world_size == 1:
        return [x]
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(_world_size)]
    dist.all_gather(parts, x)
    return parts


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """The sum of every rank's `x`, added in rank order (see the module docstring), on every rank."""
    if _world_size == 1:
        return x
    parts = all_gather(x)
    total = parts[0]
    for part in parts[1:]:
        total = total + part
    return total


def all_gather_cat(x: torch.Tensor, dim: int) -> torch.Tensor:
    """Every rank's `x` concatenated along `dim`, in rank order."""
    return x if _world_size == 1 else torch.cat(all_gather(x), dim=dim)


def all_reduce_min(value: int) -> int:
    """The smallest of every rank's `value` (ranks agree on a count, e.g. the KV pool's blocks)."""
    if _world_size == 1:
        return value
    tensor = torch.tensor([value], dtype=torch.int64)
    if dist.get_backend() == "nccl":
        tensor = tensor.cuda()
    dist.all_reduce(tensor, op=dist.ReduceOp.MIN)
    return int(tensor.item())
