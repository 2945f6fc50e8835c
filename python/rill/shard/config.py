"""The shard process's typed configuration, built once from command-line flags and passed explicitly."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from rill.kernels.quant import ACTIVATIONS as QUANTIZED_ACTIVATIONS
from rill.shard.memory import CGROUP_ROOT

# `--quantize`: the types float weights may be quantized to at load (llama.cpp's, by its names).
QUANTIZE_TYPES = ("q8_0", "q4_0")
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
DEVICES = ("cpu", "cuda")
ATTENTION_BACKENDS = ("auto", "cpu", "cuda", "torch")
KV_CACHE_DTYPES = ("auto", "int8")  # auto: the model's dtype


@dataclass(frozen=True)
class ShardConfig:
    """Everything one shard rank needs to know; nothing is read from the environment.

    `block_size` is tokens per KV block; the router's allocator uses exactly this value (it learns it
    from `Info`). `num_threads` is torch's intra-op thread count on the CPU (0 = torch's default).
    With `world_size` > 1 the ranks rendezvous through `dist_init_method`, a torch.distributed URL
    (tcp://127.0.0.1:PORT, or file:///PATH in a folder private to one launch).
    `attention_backend` picks the kernel ops (`cpu`: rill.kernels.cpu, `cuda`: rill.kernels.gpu) or the torch
    references (`torch`) for attention, KV writes, norms and rotary (auto: the device's kernels where they can
    run, see `ModelRunner._choose_ops`); `cuda_graph_max_batch_size` bounds the decode
    batch sizes captured as CUDA graphs with the kernels (0: none). `otlp_endpoint`, when set, is the
    OpenTelemetry collector the server sends its `forward` spans to (rill/shard/telemetry.py).
    `cgroup_root` is where the cgroup hierarchy is mounted: the pools are sized within the memory limits
    found there (rill/shard/memory.py; tests point it at a fake one).
    `kv_cache_dtype` is what the KV pool stores: auto, the model's dtype; int8, K/V rows quantized with a
    float32 scale each (rill/shard/kv_cache.py; the CPU kernels and the torch references only).
    `max_loras` is the number of LoRA adapter slots on the device, the most distinct adapters one forward may
    use (0: LoRA off), and `max_lora_rank` the largest adapter rank they hold (rill/shard/lora.py).
    """

    model_path: Path
    socket_path: Path
    device: str = "cpu"
    dtype: str = "float32"
    block_size: int = 16
    rank: int = 0
    world_size: int = 1
    num_threads: int = 0
    dist_init_method: str | None = None
    attention_backend: str = "auto"
    cuda_graph_max_batch_size: int = 256
    otlp_endpoint: str | None = None
    cgroup_root: Path = CGROUP_ROOT
    max_loras: int = 0
    max_lora_rank: int = 16
    quantize: str | None = None  # a QUANTIZE_TYPES type: float weights quantized at load (CPU, one rank)
    quantized_activations: str = "int16"  # what quantized weights multiply: QUANTIZED_ACTIVATIONS
    kv_cache_dtype: str = "auto"

    def __post_init__(self) -> None:
        if self.device not in DEVICES:
            raise ValueError(f"device must be one of {DEVICES}, got {self.device!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {tuple(DTYPES)}, got {self.dtype!r}")
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank must be in [0, world_size={self.world_size}), got {self.rank}")
        if self.world_size > 1 and not self.dist_init_method:
            raise ValueError(
                f"world_size {self.world_size} needs a dist_init_method (tcp://... or file://...)"
            )
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(
                f"attention_backend must be one of {ATTENTION_BACKENDS}, got {self.attention_backend!r}"
            )
        if self.attention_backend in ("cpu", "cuda") and self.device != self.attention_backend:
            raise ValueError(
                f"attention_backend {self.attention_backend!r} needs device {self.attention_backend!r}"
            )
        if self.cuda_graph_max_batch_size < 0:
            raise ValueError(f"cuda_graph_max_batch_size must be >= 0, got {self.cuda_graph_max_batch_size}")
        if self.max_loras < 0:
            raise ValueError(f"max_loras must be >= 0, got {self.max_loras}")
        if self.max_lora_rank < 1:
            raise ValueError(f"max_lora_rank must be >= 1, got {self.max_lora_rank}")
        if self.quantize is not None and self.quantize not in QUANTIZE_TYPES:
            raise ValueError(f"quantize must be one of {QUANTIZE_TYPES}, got {self.quantize!r}")
        if self.quantize is not None and (
            self.device != "cpu" or self.world_size != 1 or self.dtype != "float32"
        ):
            raise ValueError("quantize needs the cpu, one shard and float32 activations")
        if self.quantized_activations not in QUANTIZED_ACTIVATIONS:
            raise ValueError(
                f"quantized_activations must be one of {QUANTIZED_ACTIVATIONS}, "
                f"got {self.quantized_activations!r}"
            )
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")
        if self.num_threads < 0:
            raise ValueError(f"num_threads must be >= 0, got {self.num_threads}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def kv_torch_dtype(self) -> torch.dtype:
        """The KV pool's dtype: the model's, or torch.int8."""
        return torch.int8 if self.kv_cache_dtype == "int8" else self.torch_dtype

    @property
    def torch_device(self) -> torch.device:
        return torch.device(self.device if self.device == "cpu" else f"cuda:{self.rank}")
