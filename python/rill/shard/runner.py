"""`ModelRunner`: owns the model, the KV pool and per-sequence sampling params; prepare -> forward -> sample.

Lifecycle: load (constructor) -> `warmup` once (sizes and allocates the pool) -> `forward` per router call.
Per-sequence state is the `SamplingParams`, the LoRA adapter id sent with them and, for sequences with a
penalty, the `TokenHistory`, kept by id from the first call that sends the params until the id is named in
`released_ids` (or ClearCache); the KV blocks and block tables belong to the router. With `--max-loras` > 0
the runner keeps the loaded adapters (`rill.shard.lora`) and puts each call's adapters in the device slots
before its forward.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from pathlib import Path

import torch
from torch import nn

from rill.kernels.cpu import CpuOps
from rill.kernels.gpu import GpuOps
from rill.kernels.ops import AttentionMetadata, KernelOps
from rill.shard import distributed
from rill.shard.batch import (
    BatchLimits,
    BatchState,
    ForwardRequest,
    Generation,
    SequenceChunk,
    TokenHistory,
    TopLogprob,
)
from rill.shard.config import ShardConfig
from rill.shard.cuda_graphs import DecodeGraphs
from rill.shard.kv_cache import KVCache
from rill.shard.layers.attention import ForwardContext, forward_context
from rill.shard.layers.backend import install_ops, unsupported_reasons
from rill.shard.layers.decoder_stack import fuse_decoder_layers
from rill.shard.lora import HostAdapter, LoraAdapters, enable_lora
from rill.shard.memory import available_host_memory
from rill.shard.models.registry import eos_token_ids, get_model_class, load_hf_config
from rill.shard.sampling import SamplingBatch, SamplingParams, sample
from rill.shard.weights import checkpoint_shapes, load_weights, quantize_weights

logger = logging.getLogger(__name__)

# Host memory a rank may use: min(MemAvailable, its cgroup's room; see memory.py), split evenly between
# the ranks of one launch (they share the host). Device memory: what torch.cuda.mem_get_info calls free,
# which other processes on the device have already taken out; 10% of it stays free as headroom for the
# allocator's fragmentation and the activations of requests larger than the warmup's.
CPU_KV_MEMORY_FRACTION = 0.25  # of the rank's host memory
CUDA_KV_MEMORY_FRACTION = 0.90  # of free device memory after the warmup forward
SWAP_MEMORY_FRACTION = 0.10  # default swap pool: of the rank's host memory left after a CPU KV pool
# Every logit processor on, so the warmup forward reaches the sampler's peak memory.
WARMUP_PARAMS = SamplingParams(
    do_sample=True,
    top_k=50,
    top_p=0.9,
    repetition_penalty=1.1,
    frequency_penalty=0.1,
    presence_penalty=0.1,
    logit_bias={0: 1.0},
    min_p=0.05,
    typical_p=0.9,
    top_n_logprobs=20,
    stop_token_ids=(0,),
    min_new_tokens=1,
)


@dataclasses.dataclass(frozen=True)
class WarmupResult:
    """What Warmup answers (see `WarmupResponse` in the proto)."""

    num_blocks: int
    num_host_blocks: int
    swap_seconds_per_block: float
    prefill_seconds_per_token: float
    bytes_per_block: int = 0
    kv_pool_reason: str = ""  # why the KV pool has its size (the figures it came from)
    swap_pool_reason: str = ""


@dataclasses.dataclass(frozen=True)
class ForwardResult:
    """What one Prefill/Decode call produced."""

    generations: list[Generation]  # one per sampled row (k + 1 for a speculating chunk), in request order
    model_seconds: float  # wall time of the model forward, embedding to logits (reported to the router)


class NotReadyError(RuntimeError):
    """A forward was asked for before `warmup` allocated the KV pool."""


class LoraOffError(RuntimeError):
    """An adapter was to be loaded on a shard started without LoRA slots."""


class ModelRunner:
    def __init__(self, config: ShardConfig) -> None:
        self.config = config
        self.device = config.torch_device
        self.dtype = config.torch_dtype
        self.hf_config = load_hf_config(config.model_path)
        self.model_type: str = self.hf_config.get("model_type", "")
        model_class = get_model_class(self.model_type)
        # Before the model is built: its parallel layers read this rank's place in the group.
        distributed.init(config.rank, config.world_size, config.dist_init_method, self.device)
        self.model_config = model_class.config_class.from_hf(self.hf_config)
        with torch.device(self.device):
            self.model: nn.Module = model_class(self.model_config).to(self.dtype)
        load_weights(self.model, config.model_path)
        if config.quantize:
            count = quantize_weights(self.model, config.quantize)
            logger.info("quantized %d weight matrices to %s at load (--quantize)", count, config.quantize)
        self.model.eval()
        self.num_params = sum(p.numel() for p in self.model.parameters())  # before the kernels repack any
        self.eos_token_ids = eos_token_ids(config.model_path, self.hf_config)
        self.kv_cache: KVCache | None = None
        # The slot stacks exist before the ops are installed (the projections hand them the ops) and before
        # the KV pool is sized (its accounting sees their memory).
        self.adapters: LoraAdapters | None = None
        if config.max_loras:
            shapes = checkpoint_shapes(config.model_path)
            self.adapters = enable_lora(self.model, config.max_loras, config.max_lora_rank, shapes)
        self.ops = self._choose_ops()
        install_ops(self.model, self.ops)
        num_fused = fuse_decoder_layers(self.model, self.ops)  # adapters included: the stack applies them
        if num_fused:
            logger.info("%d decoder layers run as one kernel call per run of layers", num_fused)
        self.decode_graphs: DecodeGraphs | None = None
        self.params_by_id: dict[int, SamplingParams] = {}
        self.adapter_by_id: dict[int, int] = {}  # sequences that run with an adapter
        self.history = TokenHistory()
        logger.info(
            "loaded %s (%s, %.1fM parameters) from %s on %s as %s",
            model_class.__name__,
            self.model_type,
            self.num_params / 1e6,
            config.model_path,
            self.device,
            config.dtype,
        )

    def _choose_ops(self) -> KernelOps | None:
        """`--attention-backend`: auto runs the device's kernels when they can run this model here (else the
        torch references, with a log line saying why); cpu or cuda insist (an error when they cannot); torch
        always runs the references (None). The kernels are built (once, cached) or loaded here. A
        --kv-cache-dtype the device's kernels do not take (int8 on cuda) is an error whatever the backend
        asked for, unless it is torch."""
        requested = self.config.attention_backend
        if requested == "torch":
            return None
        ops: KernelOps = (
            GpuOps() if self.device.type == "cuda" else CpuOps(activations=self.config.quantized_activations)
        )
        if self.config.kv_cache_dtype not in ops.kv_cache_dtypes:
            raise ValueError(
                f"--kv-cache-dtype {self.config.kv_cache_dtype} is not supported by the {ops.name} "
                f"kernels (they take {', '.join(ops.kv_cache_dtypes)}); the CPU kernels and "
                "--attention-backend torch take int8"
            )
        reasons = unsupported_reasons(self.model, ops)
        if not reasons:
            reasons = [reason for reason in [_load_kernels(ops)] if reason]
        if reasons:
            if requested != "auto":
                raise ValueError("; ".join(reasons))
            logger.warning("%s: using the torch references", "; ".join(reasons))
            return None
        logger.info("kernels: %s (%s)", type(ops).__name__, type(ops).__module__)
        return ops

    @property
    def vocab_size(self) -> int:
        return self.model_config.vocab_size

    @property
    def kv_window(self) -> int:
        """The sliding window of every layer when all have one (the smallest), else 0: the router then
        releases blocks out of the window and sends them as the null block 0 (the router's `kv_window`)."""
        windows = self.model_config.layer_windows
        return min(windows) if windows and all(windows) else 0

    @property
    def max_position_embeddings(self) -> int:
        return self.model_config.max_position_embeddings

    def _new_kv_cache(self, num_blocks: int) -> KVCache:
        cfg = self.model_config
        return KVCache(
            cfg.num_hidden_layers,
            num_blocks,
            self.config.block_size,
            self.model.num_kv_heads,  # this rank's KV heads only
            cfg.head_dim,
            self.config.kv_torch_dtype,
            self.device,
            ops=self.ops,
        )

    def _kv_dtype_name(self) -> str:
        if self.config.kv_cache_dtype == "int8":
            return "int8 with float32 scales"
        return self.config.dtype

    def _bytes_per_block(self) -> int:
        cfg = self.model_config
        return KVCache.bytes_per_block(
            cfg.num_hidden_layers,
            self.config.block_size,
            self.model.num_kv_heads,
            cfg.head_dim,
            self.config.kv_torch_dtype,
        )

    @torch.inference_mode()
    def warmup(
        self,
        max_batch_tokens: int,
        max_batch_size: int,
        max_total_kv_tokens: int,
        swap_space_bytes: int | None = 0,
        max_speculative_tokens: int = 0,
    ) -> WarmupResult:
        """Runs a forward at the largest batch the router will send (sampling `max_speculative_tokens` more
        positions, as verifying that many proposals does), then allocates the pool (and a swap pool of
        `swap_space_bytes`, None: a share of the host memory left); returns their sizes in blocks, null block
        0 included, why they have them, and the measured costs of recomputing a token and of swapping a
        block."""
        if not 1 <= max_batch_size <= max_batch_tokens:
            raise ValueError(
                f"need 1 <= max_batch_size <= max_batch_tokens, got max_batch_size={max_batch_size}, "
                f"max_batch_tokens={max_batch_tokens}"
            )
        block_size = self.config.block_size
        self.kv_cache = None
        self.decode_graphs = None
        self.clear()
        # A throwaway pool just large enough for the dummy batch: one long sequence plus single-token ones.
        self.kv_cache = self._new_kv_cache(1 + -(-max_batch_tokens // block_size) + max_batch_size)
        lengths = [max_batch_tokens - (max_batch_size - 1)] + [1] * (max_batch_size - 1)
        next_block = 1
        sequences = []
        for i, length in enumerate(lengths):
            num_blocks = -(-length // block_size)
            sequences.append(
                SequenceChunk(
                    id=i,
                    token_ids=[0] * length,
                    num_computed_tokens=0,
                    block_table=list(range(next_block, next_block + num_blocks)),
                    sample=True,
                    params=dataclasses.replace(WARMUP_PARAMS, seed=i),
                    num_speculative_tokens=min(max_speculative_tokens, length - 1) if i == 0 else 0,
                )
            )
            next_block += num_blocks
        start = time.perf_counter()
        self._run(ForwardRequest(sequences=sequences), check_lengths=False)
        warmup_s = time.perf_counter() - start
        logger.info(
            "warmup forward of %d tokens in %d sequences took %.2fs",
            max_batch_tokens,
            max_batch_size,
            warmup_s,
        )
        self.clear()
        self.kv_cache = None
        # Every rank uses the router's block tables, so every pool needs the same number of blocks.
        host = available_host_memory(self.config.cgroup_root)
        host_share_bytes = host.available_bytes // self.config.world_size
        host_reason = (
            f"1/{self.config.world_size} of {host.reason}" if self.config.world_size > 1 else host.reason
        )
        num_blocks, kv_pool_reason = self._decide_num_blocks(
            max_total_kv_tokens, host_share_bytes, host_reason
        )
        num_blocks = distributed.all_reduce_min(num_blocks)
        self.kv_cache = self._new_kv_cache(num_blocks)
        if swap_space_bytes is None:
            host_left_bytes = host_share_bytes
            if self.device.type == "cpu":
                host_left_bytes = max(0, host_left_bytes - num_blocks * self._bytes_per_block())
            swap_space_bytes = int(host_left_bytes * SWAP_MEMORY_FRACTION)
            swap_pool_reason = (
                f"{SWAP_MEMORY_FRACTION:.0%} of {host_left_bytes / 2**30:.2f} GiB host memory left "
                f"after the KV pool; {host_reason}"
            )
        else:
            swap_pool_reason = f"router asked for {swap_space_bytes / 2**30:.2f} GiB"
        num_host_blocks = min(swap_space_bytes // self._bytes_per_block(), 2**32 - 1)  # a uint32 in the proto
        num_host_blocks = distributed.all_reduce_min(num_host_blocks)
        self.kv_cache.allocate_host_pool(num_host_blocks)
        swap_seconds_per_block = self._measure_swap() if self.kv_cache.num_host_blocks else 0.0
        if self.kv_cache.num_host_blocks:
            logger.info(
                "swap pool: %d host blocks (%.2f GiB; %s); one block out and back in takes %.1f us",
                self.kv_cache.num_host_blocks,
                self.kv_cache.num_host_blocks * self._bytes_per_block() / 2**30,
                swap_pool_reason,
                swap_seconds_per_block * 1e6,
            )
        self._capture_decode_graphs(max_batch_size, num_blocks)
        return WarmupResult(
            num_blocks=num_blocks,
            num_host_blocks=self.kv_cache.num_host_blocks,
            swap_seconds_per_block=swap_seconds_per_block,
            prefill_seconds_per_token=warmup_s / max_batch_tokens,
            bytes_per_block=self._bytes_per_block(),
            kv_pool_reason=kv_pool_reason,
            swap_pool_reason=swap_pool_reason if self.kv_cache.num_host_blocks else "",
        )

    def _measure_swap(self, num_repeats: int = 4) -> float:
        """Seconds to copy one block out to the host and back in, averaged over a few multi-block copies (the
        pool holds nothing yet, so any blocks will do)."""
        assert self.kv_cache is not None
        num_copied = min(8, self.kv_cache.num_blocks - 1, self.kv_cache.num_host_blocks - 1)
        blocks = list(range(1, num_copied + 1))
        start = time.perf_counter()
        for _ in range(num_repeats):
            self.kv_cache.swap_out(blocks, blocks)
            self.kv_cache.swap_in(blocks, blocks)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return (time.perf_counter() - start) / (num_repeats * num_copied)

    def _capture_decode_graphs(self, max_batch_size: int, num_blocks: int) -> None:
        max_graph_batch_size = min(max_batch_size, self.config.cuda_graph_max_batch_size)
        can_capture = self.ops is not None and self.ops.captures_cuda_graphs
        if not can_capture or max_graph_batch_size < 1 or self.config.world_size > 1:
            return
        assert self.kv_cache is not None
        max_context_len = min(self.max_position_embeddings, (num_blocks - 1) * self.config.block_size)
        self.decode_graphs = DecodeGraphs(
            self.model,
            self.kv_cache,
            max_graph_batch_size,
            max_blocks_per_seq=-(-max_context_len // self.config.block_size),
            max_context_len=max_context_len,
            device=self.device,
        )

    def _decide_num_blocks(
        self, max_total_kv_tokens: int, host_share_bytes: int, host_reason: str
    ) -> tuple[int, str]:
        """The pool's size in blocks (null block included) and why: what the router asked for, else a share of
        free device memory (cuda) or of this rank's host memory (cpu)."""
        block_size, bytes_per_block = self.config.block_size, self._bytes_per_block()
        if max_total_kv_tokens > 0:
            num_blocks = math.ceil(max_total_kv_tokens / block_size) + 1
            reason = f"router asked for {max_total_kv_tokens} tokens"
        elif self.device.type == "cuda":
            free_bytes, _ = torch.cuda.mem_get_info(self.device)
            num_blocks = int(free_bytes * CUDA_KV_MEMORY_FRACTION) // bytes_per_block
            reason = f"{CUDA_KV_MEMORY_FRACTION:.0%} of {free_bytes / 2**30:.2f} GiB free device memory"
        else:
            num_blocks = int(host_share_bytes * CPU_KV_MEMORY_FRACTION) // bytes_per_block
            reason = f"{CPU_KV_MEMORY_FRACTION:.0%} of {host_share_bytes / 2**30:.2f} GiB: {host_reason}"
        if num_blocks < 2:
            raise RuntimeError(f"not enough memory for a KV pool of 2 blocks ({reason})")
        logger.info(
            "KV pool: %d blocks of %d tokens (%d usable tokens, %.2f GiB, KV dtype %s); %s",
            num_blocks,
            block_size,
            (num_blocks - 1) * block_size,
            num_blocks * bytes_per_block / 2**30,
            self._kv_dtype_name(),
            reason,
        )
        return num_blocks, reason

    @torch.inference_mode()
    def forward(self, request: ForwardRequest) -> ForwardResult:
        """Drops released sequences, then runs one forward pass over all chunks; one Generation per sampled
        row (a chunk's last num_speculative_tokens + 1 positions), in request order, and the model's time."""
        if self.kv_cache is None:
            raise NotReadyError("Warmup must be called before Prefill or Decode")
        for seq_id in request.released_ids:
            self.params_by_id.pop(seq_id, None)
            self.adapter_by_id.pop(seq_id, None)
            self.history.release(seq_id)
        if self.adapters is not None:
            self.adapters.unload(request.unloaded_adapter_ids)
        # Swapped-out blocks leave before anything overwrites them; swapped-in ones arrive before the forward.
        self.kv_cache.swap_out(
            [c.device_block for c in request.swap_out], [c.host_block for c in request.swap_out]
        )
        self.kv_cache.swap_in(
            [c.host_block for c in request.swap_in], [c.device_block for c in request.swap_in]
        )
        return self._run(request)

    def _run(self, request: ForwardRequest, check_lengths: bool = True) -> ForwardResult:
        batch, logits, model_seconds = self.forward_logits(request, check_lengths)
        if not batch.sample_ids:
            return ForwardResult([], model_seconds)
        # Everything per sampled row: a speculating chunk's rows share the sequence's params, and each row
        # sees the history before its own position (the recorded history already holds the proposals).
        masks = {seq.id: seq.allowed_token_bitmask for seq in request.sequences if seq.allowed_token_bitmask}
        sampling = SamplingBatch.build(
            [self.params_by_id[seq_id] for seq_id in batch.sample_ids],
            batch.sample_positions,
            self.device,
            histories=[
                self.history.before(seq_id, position)
                for seq_id, position in zip(batch.sample_ids, batch.sample_positions, strict=True)
            ],
            vocab_size=self.vocab_size,
            allowed_token_bitmasks=[masks.get(seq_id, ()) for seq_id in batch.sample_ids],
        )
        out = sample(logits, sampling, self.ops)
        generations = [
            Generation(
                id=seq_id,
                token_id=token_id,
                logprob=logprob,
                top_logprobs=[TopLogprob(t, lp) for t, lp in zip(top_ids[:n], top_lps[:n], strict=True)],
            )
            for seq_id, token_id, logprob, top_ids, top_lps, n in zip(
                batch.sample_ids,
                out.token_ids.tolist(),
                out.logprobs.tolist(),
                out.top_token_ids.tolist(),
                out.top_logprobs.tolist(),
                sampling.top_n_logprobs,
                strict=True,
            )
        ]
        return ForwardResult(generations, model_seconds)

    @torch.inference_mode()
    def forward_logits(
        self, request: ForwardRequest, check_lengths: bool = True
    ) -> tuple[BatchState, torch.Tensor, float]:
        """Validates, stores new params, runs the model (writing K/V) and returns float32 logits
        [num_sampled, vocab] of the sampled rows, in request order, and the model's wall time in seconds.
        Does not drop `released_ids`."""
        if self.kv_cache is None:
            raise NotReadyError("Warmup must be called before Prefill or Decode")
        limits = BatchLimits(
            vocab_size=self.vocab_size,
            max_position_embeddings=self.max_position_embeddings if check_lengths else 2**62,
            block_size=self.config.block_size,
            num_blocks=self.kv_cache.num_blocks,
            kv_window=self.kv_window,
        )
        batch = BatchState.prepare(request.sequences, self.params_by_id, limits, self.device)
        adapter_ids = self._adapter_ids(request.sequences)
        lora_slots = self._lora_slots(request.sequences, adapter_ids)
        self.history.record(request.sequences, self.params_by_id)
        for seq in request.sequences:
            if seq.params is not None:
                self.params_by_id[seq.id] = seq.params
                if seq.adapter_id:
                    self.adapter_by_id[seq.id] = seq.adapter_id
                else:
                    self.adapter_by_id.pop(seq.id, None)
        start = time.perf_counter()
        # A decode graph holds no adapter product: steps with adapters run eagerly.
        if self.decode_graphs is not None and lora_slots is None and self.decode_graphs.can_run(batch):
            hidden = self.decode_graphs.run(batch)
        else:
            meta = AttentionMetadata.build(
                batch.cu_seqlens_q,
                batch.context_lens,
                batch.block_tables,
                batch.slot_mapping,
                batch.positions,
            )
            with forward_context(ForwardContext(self.kv_cache, meta, lora_slots)):
                hidden = self.model(batch.input_ids, batch.positions)
        logits = self.model.compute_logits(hidden[batch.sample_rows])
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return batch, logits, time.perf_counter() - start

    def _adapter_ids(self, sequences: list[SequenceChunk]) -> list[int]:
        """Each sequence's adapter id (0: the base model), checked to be loaded."""
        adapter_ids = []
        for seq in sequences:
            adapter_id = seq.adapter_id if seq.params is not None else self.adapter_by_id.get(seq.id, 0)
            if adapter_id and (self.adapters is None or not self.adapters.is_loaded(adapter_id)):
                off = " (LoRA is off: --max-loras 0)" if self.adapters is None else ""
                raise ValueError(
                    f"sequence {seq.id}: adapter_id {adapter_id} is not loaded on the shard{off}"
                )
            adapter_ids.append(adapter_id)
        return adapter_ids

    def _lora_slots(self, sequences: list[SequenceChunk], adapter_ids: list[int]) -> torch.Tensor | None:
        """Puts the call's adapters in the device slots; each token row's slot (-1: base), None when no
        sequence has an adapter."""
        if self.adapters is None or not any(adapter_ids):
            return None
        slots = self.adapters.assign_slots(set(adapter_ids) - {0})
        row_slots = [
            slots.get(adapter_id, -1)
            for seq, adapter_id in zip(sequences, adapter_ids, strict=True)
            for _ in seq.token_ids
        ]
        return torch.tensor(row_slots, dtype=torch.int32, device=self.device)

    def load_adapter(self, adapter_id: int, path: Path) -> HostAdapter:
        """Reads a PEFT LoRA adapter folder into host memory under `adapter_id` (ValueError: a folder this
        shard cannot serve)."""
        if self.adapters is None:
            raise LoraOffError(
                "LoRA is off on this shard: start it with --max-loras N (N > 0) to load adapters"
            )
        return self.adapters.load(adapter_id, path)

    def clear(self) -> None:
        """Forgets every sequence (the pool's contents are the router's business and stay allocated)."""
        self.params_by_id.clear()
        self.adapter_by_id.clear()
        self.history.clear()

    def health(self) -> bool:
        """A tiny device op: raises if the device is unusable. Returns whether Warmup has run."""
        probe = torch.ones(1, device=self.device) + 1
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        assert probe.item() == 2.0
        return self.kv_cache is not None


def _load_kernels(ops: KernelOps) -> str | None:
    """Builds (first time) or loads `ops`' kernels; why they cannot be used here, or None."""
    reason = ops.unavailable_reason()
    if reason:
        return reason
    try:
        ops.load()
    except (RuntimeError, OSError) as error:  # a failed compile: torch's extension builder says why
        return f"building the {ops.name} kernels failed ({error})"
    return None
