"""How close Rill's forward pass runs to this machine's floor, measured in one run.

    python -m bench.suite roofline [--dtype float32|bfloat16] [--num-threads N] [--plot roofline.png]
    python -m bench.suite roofline --quantized-activations float32|int16|int8   # the default model's GGUF

Measures, on the machine it runs on: memory read bandwidth (a large sum), GEMM rate (a square matmul,
float32 and bfloat16), then the shard's `ModelRunner` in-process (no router, no gRPC: the model's own step)
for decode steps at batch 1/4/16/32/64 and contexts 128/512/2048, and prefills of 128/512/2048-token prompts.
Each figure is printed next to its floor: weight + KV bytes over the measured bandwidth, or FLOPs over the
measured GEMM rate, whichever is larger (a roofline). A decode step includes batch preparation and
sampling, as served. Last, one decode step's matmuls at batch 1-64 three ways: torch's GEMM padded to 16
rows (the torch reference), unpadded (not batch-invariant) and Rill's CPU linear kernel (batch-invariant).
With `--quantized-activations` the model is served from its GGUF file as it is (quantized matrices kept in the
file's types): the floor counts the bytes the kernels really stream, and the matmuls are timed with float32,
int16 and int8 activations side by side, next to their own floor (the matrices' bytes over the bandwidth).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from rill.shard.batch import ForwardRequest, SequenceChunk
from rill.shard.config import ShardConfig
from rill.shard.runner import ModelRunner
from rill.shard.sampling import SamplingParams

BATCH_SIZES = (1, 4, 16, 32, 64)
CONTEXTS = (128, 512, 2048)
PROMPT_LENS = (128, 512, 2048)


def _median_seconds(run: Callable[[], object], repeats: int, warmup: int = 1) -> float:
    for _ in range(warmup):
        run()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure_bandwidth(num_bytes: int = 1 << 30) -> float:
    """Bytes per second of reading a float32 tensor larger than any cache (a sum over it)."""
    data = torch.ones(num_bytes // 4, dtype=torch.float32)
    return num_bytes / _median_seconds(data.sum, repeats=5)


def measure_gemm(dtype: torch.dtype, size: int = 2048) -> float:
    """FLOP/s of a square [size x size] @ [size x size] matmul in `dtype`."""
    a = torch.randn(size, size).to(dtype)
    b = torch.randn(size, size).to(dtype)
    return 2 * size**3 / _median_seconds(lambda: a @ b, repeats=5)


@dataclasses.dataclass(frozen=True)
class ModelCosts:
    """What one forward reads and computes, from the loaded model's shapes."""

    layer_params: int  # weights every token is multiplied by (decoder layers and norms)
    lm_head_params: int  # multiplied by once per sampled row
    kv_bytes_per_token: int  # K and V of every layer, at the pool's dtype
    attention_flops_per_key: int  # per query token per key: q.k and p.v over all heads and layers
    weight_bytes: int  # read once per forward: the layers and the LM head (embedding rows: negligible)


def streamed_weight_bytes(runner: ModelRunner) -> int:
    """The bytes one forward reads of the weights as the kernels hold them: each packed matrix once (packed
    floats, or quantized blocks as the file has them; a tied head and its embedding share one), and the float
    parameters left (norms); an embedding that is only looked up is not streamed."""
    from rill.shard.layers.embedding import Embedding

    tensors: dict[int, int] = {}
    for module in runner.model.modules():
        packed = getattr(module, "packed", None)
        if packed is not None and not isinstance(module, Embedding):
            tensors[id(packed.tensor)] = packed.tensor.numel() * packed.tensor.element_size()
    embedding = runner.model.model.embed_tokens.weight
    for param in runner.model.parameters():
        if param is not embedding or runner.model.lm_head.is_tied:
            tensors.setdefault(id(param), param.numel() * param.element_size())
    return sum(tensors.values())


def model_costs(runner: ModelRunner) -> ModelCosts:
    cfg = runner.model_config
    element = torch.finfo(runner.dtype).bits // 8
    embedding = runner.model_config.vocab_size * cfg.hidden_size  # the LM head has the same shape
    # Counted at load, before the CPU kernels replaced weights by packed copies; a tied head counted once.
    layer_params = runner.num_params - embedding - (0 if runner.model.lm_head.is_tied else embedding)
    return ModelCosts(
        layer_params=layer_params,
        lm_head_params=embedding,
        kv_bytes_per_token=2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * element,
        attention_flops_per_key=4 * cfg.num_hidden_layers * cfg.num_attention_heads * cfg.head_dim,
        weight_bytes=streamed_weight_bytes(runner),
    )


class StepDriver:
    """Builds decode and prefill calls over a fresh region of the runner's KV pool."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.block_size = runner.config.block_size
        self.next_id = 0

    def _sequences(self, batch: int, context: int, num_new: int) -> list[SequenceChunk]:
        num_blocks = -(-context // self.block_size)
        assert self.runner.kv_cache is not None
        pool_blocks = self.runner.kv_cache.num_blocks - 1
        sequences = []
        for i in range(batch):
            first = 1 + (i * num_blocks) % max(1, pool_blocks - num_blocks)
            self.next_id += 1
            sequences.append(
                SequenceChunk(
                    id=self.next_id,
                    token_ids=[(7 * i + j) % 1000 + 1 for j in range(num_new)],
                    num_computed_tokens=context - num_new,
                    block_table=list(range(first, first + num_blocks)),
                    sample=True,
                    params=SamplingParams(),
                )
            )
        return sequences

    def step(self, batch: int, context: int, num_new: int) -> Callable[[], object]:
        sequences = self._sequences(batch, context, num_new)
        self.runner.forward(ForwardRequest(sequences=sequences))  # stores params; later calls omit them
        repeated = [dataclasses.replace(s, params=None) for s in sequences]
        return lambda: self.runner.forward(ForwardRequest(sequences=repeated))


LINEAR_BATCH_SIZES = (1, 2, 4, 8, 16, 64)


def measure_linears(runner: ModelRunner, repeats: int, bandwidth: float) -> list[dict[str, Any]]:
    """One decode step's matmuls (every Linear and the LM head of the model) at small batch sizes, three ways:
    torch's GEMM padded to ROW_MULTIPLE rows (the torch reference's batch-invariant form), torch's GEMM
    unpadded (not batch-invariant), and Rill's CPU linear kernel (batch-invariant at any row count)."""
    from rill.kernels import cpu as cpu_kernels
    from rill.shard.layers.embedding import LMHead
    from rill.shard.layers.linear import Linear, invariant_matmul

    layers = [m for m in runner.model.modules() if isinstance(m, Linear | LMHead)]
    if any(m.packed is not None and m.packed.tensor.dtype == torch.uint8 for m in layers):
        return measure_quantized_linears(runner, layers, repeats, bandwidth)
    # The runner's layers hold packed weights; the same shapes with random values time the same.
    packed_layers = [
        m.packed for m in layers if m.packed and m.packed.tensor.dtype in cpu_kernels.linear_dtypes()
    ]
    weights = [torch.randn(p.out_features, p.in_features).to(runner.dtype) for p in packed_layers]
    ops = cpu_kernels.CpuOps()
    packed = {id(w): ops.pack_linear(w) for w in weights}
    print(f"{'matmuls':>8} {'torch padded ms':>15} {'unpadded ms':>15} {'rill kernel ms':>15}")
    ways = {
        "torch padded": lambda x, w: invariant_matmul(x, w),
        "torch unpadded": lambda x, w: x @ w.T,
        "rill kernel": lambda x, w: ops.linear(x, packed[id(w)], w.shape[0]),
    }
    rows = []
    for batch in LINEAR_BATCH_SIZES:
        inputs = [torch.randn(batch, w.shape[1]).to(w.dtype) for w in weights]
        row: dict[str, Any] = {"batch": batch}
        for name, matmul in ways.items():

            def step(
                matmul: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = matmul,
                inputs: list[torch.Tensor] = inputs,
            ) -> None:
                for x, w in zip(inputs, weights, strict=True):
                    matmul(x, w)

            row[name] = _median_seconds(step, repeats=repeats)
        rows.append(row)
        print(f"{batch:>8} " + " ".join(f"{row[name] * 1e3:>15.1f}" for name in ways), flush=True)
    return rows


def measure_quantized_linears(
    runner: ModelRunner, layers: list[Any], repeats: int, bandwidth: float
) -> list[dict[str, Any]]:
    """One decode step's quantized matmuls (the model's own matrices, each once) with each kind of
    activations, next to their floor: the matrices' bytes over the measured bandwidth."""
    from rill.kernels import cpu as cpu_kernels
    from rill.kernels.quant import ACTIVATIONS

    lib = cpu_kernels.load()
    matrices = {id(m.packed.tensor): m.packed for m in layers if m.packed.tensor.dtype == torch.uint8}
    floor = sum(p.tensor.numel() for p in matrices.values()) / bandwidth
    # The same matrices, re-packed for the other activations (the packing decides; the bytes are the same).
    ways = {
        activations: [
            cpu_kernels.CpuOps(activations).pack_quantized(quantized_parts(lib, p.tensor))
            for p in matrices.values()
        ]
        for activations in ACTIVATIONS
    }
    heads = "".join(f"{name + ' act ms':>16}" for name in ways)
    print(f"{'matmuls':>8} {'floor ms':>9}{heads}  (quantized, as the file)")
    rows = []
    for batch in LINEAR_BATCH_SIZES:
        inputs = [torch.randn(batch, p.in_features) for p in matrices.values()]
        row: dict[str, Any] = {"batch": batch, "floor": floor}
        for name, packed in ways.items():

            def step(packed: list[torch.Tensor] = packed, inputs: list[torch.Tensor] = inputs) -> None:
                for x, matrix in zip(inputs, packed, strict=True):
                    lib.quantized_linear(x, matrix)

            row[name] = _median_seconds(step, repeats=repeats)
        rows.append(row)
        times = "".join(f"{row[name] * 1e3:>16.2f}" for name in ways)
        print(f"{batch:>8} {floor * 1e3:>9.2f}{times}", flush=True)
    return rows


def quantized_parts(lib: Any, packed: torch.Tensor) -> list[Any]:
    """The parts of a packed quantized matrix back as `QuantizedTensor`s (the file's rows)."""
    from rill.kernels.quant import QTYPES, QuantizedTensor

    _, k = lib.quant_shape(packed)
    names = {number: name for name, (number, _, _) in QTYPES.items()}
    return [
        QuantizedTensor(names[qtype], lib.quant_file_rows(packed, p), k)
        for p, (qtype, _) in enumerate(lib.quant_parts(packed))
    ]


def load_runner(
    model_id: Path, dtype: str, max_context: int, max_batch: int, quantized_activations: str = "float32"
) -> ModelRunner:
    config = ShardConfig(
        model_path=model_id,
        socket_path=Path(tempfile.gettempdir()) / "unused.sock",
        dtype=dtype,
        quantized_activations=quantized_activations,
    )
    runner = ModelRunner(config)
    max_tokens = max_context * max_batch
    runner.warmup(max_batch_tokens=2048, max_batch_size=max_batch, max_total_kv_tokens=max_tokens + 4096)
    return runner


def run(args: argparse.Namespace) -> dict[str, Any]:
    from rill.convert import ensure_default_model

    torch.set_num_threads(args.num_threads)
    bandwidth = measure_bandwidth()
    gemm = {
        str(dtype).removeprefix("torch."): measure_gemm(dtype) for dtype in (torch.float32, torch.bfloat16)
    }
    print(
        f"[roofline] {args.num_threads} threads: memory read {bandwidth / 1e9:.1f} GB/s; GEMM float32 "
        f"{gemm['float32'] / 1e9:.0f} GFLOP/s, bfloat16 {gemm['bfloat16'] / 1e9:.0f} GFLOP/s",
        flush=True,
    )
    quantized = args.quantized_activations != "none"
    model_id = args.model_id or ensure_default_model(quantized=quantized)
    activations = args.quantized_activations if quantized else "float32"
    runner = load_runner(model_id, args.dtype, max(CONTEXTS), max(BATCH_SIZES), activations)
    costs = model_costs(runner)
    rate = gemm[args.dtype]
    driver = StepDriver(runner)
    decode_rows, prefill_rows = [], []
    print(f"[roofline] {args.dtype}: weights {costs.weight_bytes / 1e6:.0f} MB read per forward")
    print(f"{'decode':>8} {'context':>8} {'step ms':>9} {'floor ms':>9} {'x floor':>8} {'bound':>7}")
    for context in CONTEXTS:
        for batch in BATCH_SIZES:
            seconds = _median_seconds(driver.step(batch, context, 1), repeats=args.repeats)
            memory_s = (costs.weight_bytes + batch * context * costs.kv_bytes_per_token) / bandwidth
            flops = batch * (2 * costs.layer_params + 2 * costs.lm_head_params)
            flops += batch * context * costs.attention_flops_per_key
            compute_s = flops / rate
            floor = max(memory_s, compute_s)
            bound = "memory" if memory_s >= compute_s else "compute"
            decode_rows.append(dict(batch=batch, context=context, seconds=seconds, floor=floor, bound=bound))
            print(
                f"{batch:>8} {context:>8} {seconds * 1e3:>9.1f} {floor * 1e3:>9.1f} "
                f"{seconds / floor:>8.2f} {bound:>7}",
                flush=True,
            )
    print(f"{'prefill':>8} {'tokens/s':>9} {'GFLOP/s':>9} {'of GEMM':>8}")
    for prompt_len in PROMPT_LENS:
        seconds = _median_seconds(driver.step(1, prompt_len, prompt_len), repeats=max(1, args.repeats // 3))
        flops = 2 * costs.layer_params * prompt_len + 2 * costs.lm_head_params
        flops += costs.attention_flops_per_key * prompt_len * (prompt_len + 1) // 2
        achieved = flops / seconds
        prefill_rows.append(dict(prompt_len=prompt_len, seconds=seconds, flops_per_s=achieved))
        print(
            f"{prompt_len:>8} {prompt_len / seconds:>9.0f} {achieved / 1e9:>9.0f} {achieved / rate:>8.0%}",
            flush=True,
        )
    linear_rows = measure_linears(runner, args.repeats, bandwidth)
    report = dict(
        bandwidth=bandwidth,
        gemm=gemm,
        dtype=args.dtype,
        threads=args.num_threads,
        decode=decode_rows,
        prefill=prefill_rows,
        linears=linear_rows,
    )
    if args.plot:
        plot(report, args.plot)
    return report


def plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, len(CONTEXTS), figsize=(5 * len(CONTEXTS), 4), sharey=True)
    for axis, context in zip(axes, CONTEXTS, strict=True):
        rows = [r for r in report["decode"] if r["context"] == context]
        batches = [r["batch"] for r in rows]
        axis.plot(batches, [r["seconds"] * 1e3 for r in rows], "o-", label="Rill decode step")
        axis.plot(batches, [r["floor"] * 1e3 for r in rows], "k--", label="floor (roofline)")
        axis.set_xscale("log", base=2)
        axis.set_yscale("log")
        axis.set_xlabel("batch size (sequences)")
        axis.set_title(f"context {context}, {report['dtype']}, {report['threads']} threads")
        axis.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel("step time (ms)")
    axes[0].legend()
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    print(f"[roofline] plot: {path}")
