"""CUDA graphs of decode steps: captured at warmup for a set of batch sizes, replayed when a step fits one.

Only with kernel ops that can be captured (the CUDA kernels: no host memory, no sync), on one shard, never on
the CPU. Each captured size has views into one set of static input buffers sized for the largest; a decode
step of n sequences replays the smallest captured size >= n after copying its inputs into rows [0, n). Padding
rows [n, size) are reset on every replay to a harmless dummy: token 0 at position 0, context length 1, block
table of null block 0 and slot 0, so they write and read only the null block (which no sequence owns).

The graphs hold the KV pool's tensors; `ModelRunner.warmup` recaptures whenever it allocates a new pool.
"""

from __future__ import annotations

import logging
import time

import torch
from torch import nn

from rill.kernels.ops import AttentionMetadata
from rill.shard.batch import BatchState
from rill.shard.kv_cache import KVCache
from rill.shard.layers.attention import ForwardContext, forward_context
from rill.shard.layers.rotary import RotaryEmbedding

logger = logging.getLogger(__name__)

CAPTURE_BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256)


class DecodeGraphs:
    def __init__(
        self,
        model: nn.Module,
        kv_cache: KVCache,
        max_batch_size: int,
        max_blocks_per_seq: int,
        max_context_len: int,
        device: torch.device,
    ) -> None:
        self.batch_sizes = [size for size in CAPTURE_BATCH_SIZES if size <= max_batch_size]
        self.max_blocks_per_seq = max_blocks_per_seq
        largest = self.batch_sizes[-1]
        zeros = dict(dtype=torch.int64, device=device)
        self.input_ids = torch.zeros(largest, **zeros)
        self.positions = torch.zeros(largest, **zeros)
        self.slot_mapping = torch.zeros(largest, **zeros)
        self.block_tables = torch.zeros(largest, max_blocks_per_seq, **zeros)
        self.context_lens = torch.ones(largest, dtype=torch.int32, device=device)
        self.cu_seqlens_q = torch.arange(largest + 1, dtype=torch.int32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        start = time.perf_counter()
        for (
            module
        ) in model.modules():  # a graph gathers cos/sin from the tables it captured: they must not grow
            if isinstance(module, RotaryEmbedding):
                module.table().reserve(max_context_len)
        pool = torch.cuda.graph_pool_handle()
        for size in reversed(self.batch_sizes):  # largest first: the smaller ones reuse its memory pool
            ctx = self._context(kv_cache, size, max_context_len)
            with forward_context(ctx):  # warm up outside capture (lazy inits, allocator)
                model(self.input_ids[:size], self.positions[:size])
            torch.cuda.synchronize(device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool), forward_context(ctx):
                self.outputs[size] = model(self.input_ids[:size], self.positions[:size])
            self.graphs[size] = graph
        torch.cuda.synchronize(device)
        logger.info(
            "captured decode CUDA graphs for batch sizes %s in %.1fs",
            self.batch_sizes,
            time.perf_counter() - start,
        )

    def _context(self, kv_cache: KVCache, size: int, max_context_len: int) -> ForwardContext:
        meta = AttentionMetadata(
            block_tables=self.block_tables[:size],
            slot_mapping=self.slot_mapping[:size],
            positions=self.positions[:size],
            cu_seqlens_q=self.cu_seqlens_q[: size + 1],
            context_lens=self.context_lens[:size],
            max_query_len=1,
            max_context_len=max_context_len,
        )
        return ForwardContext(kv_cache, meta)

    def can_run(self, batch: BatchState) -> bool:
        num_seqs = len(batch.context_lens)
        return (
            batch.num_tokens == num_seqs
            and num_seqs <= self.batch_sizes[-1]
            and batch.block_tables.shape[1] <= self.max_blocks_per_seq
        )

    def run(self, batch: BatchState) -> torch.Tensor:
        """Final hidden states [num_seqs, hidden] of a decode step (`can_run` must hold); valid until the next
        replay."""
        num_seqs = len(batch.context_lens)
        size = next(size for size in self.batch_sizes if size >= num_seqs)
        num_blocks = batch.block_tables.shape[1]
        self.input_ids[:num_seqs].copy_(batch.input_ids)
        self.positions[:num_seqs].copy_(batch.positions)
        self.slot_mapping[:num_seqs].copy_(batch.slot_mapping)
        self.block_tables[:num_seqs, :num_blocks].copy_(batch.block_tables)
        self.block_tables[:num_seqs, num_blocks:].zero_()
        context_lens = torch.tensor(batch.context_lens, dtype=torch.int32)
        self.context_lens[:num_seqs].copy_(context_lens, non_blocking=True)
        # Padding rows: reset every time, a previous larger step left real slots there.
        self.input_ids[num_seqs:size].zero_()
        self.positions[num_seqs:size].zero_()
        self.slot_mapping[num_seqs:size].zero_()
        self.block_tables[num_seqs:size].zero_()
        self.context_lens[num_seqs:size].fill_(1)
        self.graphs[size].replay()
        return self.outputs[size][:num_seqs]
