"""The one GPU check of rill.kernels.cuda: build, correctness against the torch references, timings; one
table.

    python -m bench.gpu_check            (about 2-4 minutes on one H100/H200-class GPU; exit 1 on any FAIL)

Correctness: every kernel against its shard reference on fresh random data (block sizes 16/32, head dims
64/128, GQA 1/4/8, contexts 1..32k, batch 1..256), outputs poisoned with NaN so unwritten elements show;
relative error (max |a - e| / max |e|) <= 1e-2 for bf16/fp16, <= 1e-5 for fp32. Timing: CUDA events, medians.
Decode attention bandwidth (K+V bytes read / time) must reach 80% of a measured device-to-device copy at
batch 64 x 4k context. End to end: decode steps/s of a 1B-class Llama (random weights, bf16), torch
references vs kernels, without and with CUDA graphs.
"""

from __future__ import annotations

import statistics
import sys
import time

import torch
from rill.kernels import cuda
from rill.kernels.ops import AttentionMetadata
from rill.shard.layers.attention import ForwardContext, forward_context
from rill.shard.layers.backend import install_ops
from rill.shard.layers.norm import RMSNorm
from rill.shard.layers.rotary import RotaryEmbedding

from bench.kernel_cases import (
    make_case,
    max_relative_error,
    run_attention,
    run_attention_poisoned,
)

OPS = cuda.CudaOps()

TOLERANCE = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 1e-2}
ROWS: list[tuple[str, str, str, str, str]] = []  # check, shape, value, limit, status
failures = 0


def record(
    check: str, shape: str, value: float, limit: float | None, unit: str = "", higher: bool = False
) -> None:
    global failures
    if limit is None:
        status = "info"
    else:
        ok = value >= limit if higher else value <= limit
        status = "PASS" if ok else "FAIL"
        failures += not ok
    ROWS.append((check, shape, f"{value:.3g}{unit}", "" if limit is None else f"{limit:.3g}{unit}", status))
    print(f"{status:4} {check:28} {shape:48} {value:.3g}{unit}", flush=True)


def time_ms(fn, iters: int = 20, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def copy_bandwidth() -> float:
    """Bytes/s of a 1 GiB device-to-device copy (read + write counted)."""
    src = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src))
    return 2 * src.numel() / (ms / 1e3)


def check_attention() -> None:
    name = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}
    decode_cases = [  # (batch contexts, heads, kv heads, head_dim, block size, dtype)
        ([1, 2, 15, 16, 17, 255, 256, 257, 1000], 8, 8, 64, 16, torch.bfloat16),
        ([32768], 32, 8, 128, 16, torch.bfloat16),
        ([32768, 1, 4097], 32, 4, 64, 32, torch.float16),
        (
            [int(n) for n in torch.randint(1, 513, (256,), generator=torch.Generator().manual_seed(1))],
            32,
            8,
            64,
            16,
            torch.bfloat16,
        ),
        (
            [int(n) for n in torch.randint(1, 4097, (64,), generator=torch.Generator().manual_seed(2))],
            32,
            4,
            128,
            32,
            torch.bfloat16,
        ),
        ([1, 100, 3000, 9000], 16, 2, 128, 32, torch.float32),
        ([7, 700], 8, 1, 64, 16, torch.float32),
    ]
    for seed, (contexts, heads, kv_heads, head_dim, block_size, dtype) in enumerate(decode_cases):
        case = make_case(
            [1] * len(contexts), contexts, heads, kv_heads, head_dim, block_size, dtype, seed=seed
        )
        expected, k_ref, v_ref = run_attention(case, None)
        actual, k_out, v_out = run_attention(case, OPS)
        shape = f"b{len(contexts)} ctx<={max(contexts)} h{heads}/{kv_heads} d{head_dim} bs{block_size}"
        shape += f" {name[dtype]}"
        error = max(
            max_relative_error(actual, expected),
            max_relative_error(run_attention_poisoned(case, 1), expected),
            max_relative_error(run_attention_poisoned(case, 7), expected),
        )
        record("decode attention", shape[:48], error, TOLERANCE[dtype])
        same_pool = torch.equal(k_out.nan_to_num(3.0), k_ref.nan_to_num(3.0)) and torch.equal(
            v_out.nan_to_num(3.0), v_ref.nan_to_num(3.0)
        )
        record("store_kv (pool == ref)", shape[:48], 0.0 if same_pool else 1.0, 0.0)
    prefill_cases = [  # (query lens, contexts, heads, kv heads, head_dim, block size, dtype)
        ([1000], [1000], 32, 8, 64, 16, torch.bfloat16),
        ([512, 37, 1, 1, 200], [512, 4133, 9, 32768, 1200], 32, 4, 128, 32, torch.bfloat16),
        ([64, 1, 300], [2000, 1, 300], 8, 8, 128, 16, torch.float16),
        ([33, 128, 1], [500, 128, 77], 16, 2, 64, 16, torch.float32),
    ]
    for seed, (query_lens, contexts, heads, kv_heads, head_dim, block_size, dtype) in enumerate(
        prefill_cases
    ):
        case = make_case(query_lens, contexts, heads, kv_heads, head_dim, block_size, dtype, seed=100 + seed)
        expected, _, _ = run_attention(case, None)
        error = max(
            max_relative_error(run_attention(case, OPS)[0], expected),
            max_relative_error(run_attention_poisoned(case), expected),
        )
        shape = (
            f"q{query_lens} ctx<={max(contexts)} h{heads}/{kv_heads} d{head_dim} bs{block_size} {name[dtype]}"
        )
        record("prefill attention", shape[:48], error, TOLERANCE[dtype])


def check_norm_rotary() -> None:
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        torch.manual_seed(0)
        norm = RMSNorm(2048, 1e-5).to(dtype).cuda()
        norm.weight.data = torch.randn(2048, device="cuda").to(dtype)
        x = torch.randn(257, 2048, device="cuda").to(dtype)
        residual = torch.randn(257, 2048, device="cuda").to(dtype)
        expected, expected_residual = norm(x, residual)
        norm.use_ops(OPS)
        actual, actual_residual = norm(x, residual)
        error = max(
            max_relative_error(actual, expected), max_relative_error(actual_residual, expected_residual)
        )
        record("fused add + RMSNorm", f"257x2048 {dtype}", error, TOLERANCE[dtype])
        for head_dim in (64, 128):
            rotary = RotaryEmbedding(head_dim, 500000.0, None)
            rotary.inv_freq = rotary.inv_freq.cuda()
            qkv = torch.randn(300, 48 * head_dim, device="cuda").to(dtype)
            positions = torch.randint(0, 32768, (300,), device="cuda")
            q_ref, k_ref = rotary(
                positions,
                qkv[:, : 32 * head_dim].view(300, 32, head_dim),
                qkv[:, 32 * head_dim : 40 * head_dim].view(300, 8, head_dim),
            )
            out = qkv.clone()
            rotary.use_ops(OPS)
            rotary(
                positions,
                out[:, : 32 * head_dim].view(300, 32, head_dim),
                out[:, 32 * head_dim : 40 * head_dim].view(300, 8, head_dim),
            )
            error = max(
                max_relative_error(out[:, : 32 * head_dim].view(300, 32, head_dim), q_ref),
                max_relative_error(out[:, 32 * head_dim : 40 * head_dim].view(300, 8, head_dim), k_ref),
                0.0 if torch.equal(out[:, 40 * head_dim :], qkv[:, 40 * head_dim :]) else 1.0,
            )
            record("rotary (in place)", f"300 tok h32/8 d{head_dim} {dtype}", error, TOLERANCE[dtype])


def check_decode_bandwidth(copy_bytes_per_s: float) -> None:
    for heads, kv_heads, head_dim in ((32, 8, 64), (32, 8, 128)):
        case = make_case([1] * 64, [4096] * 64, heads, kv_heads, head_dim, 16, torch.bfloat16, seed=7)
        meta = case.metadata()
        k_pool, v_pool = case.k_pool.nan_to_num(0.0), case.v_pool.nan_to_num(0.0)

        def decode(case=case, k_pool=k_pool, v_pool=v_pool, meta=meta) -> torch.Tensor:
            return OPS.paged_attention(case.q, k_pool, v_pool, meta, case.scale)

        ms = time_ms(decode)
        kv_bytes = 2 * 64 * 4096 * kv_heads * head_dim * 2
        fraction = kv_bytes / (ms / 1e3) / copy_bytes_per_s
        shape = f"b64 x 4096 h{heads}/{kv_heads} d{head_dim} bf16 ({ms * 1e3:.0f} us)"
        record("decode bandwidth / copy", shape, fraction, 0.8, higher=True)


def check_end_to_end() -> None:
    from rill.shard.cuda_graphs import DecodeGraphs
    from rill.shard.kv_cache import KVCache
    from rill.shard.models.llama import LlamaConfig, LlamaForCausalLM

    hf = dict(
        model_type="llama",
        vocab_size=128256,
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        max_position_embeddings=8192,
        rope_theta=500000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
    )
    config = LlamaConfig.from_hf(hf)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = LlamaForCausalLM(config).to(torch.bfloat16).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(torch.ones_like(param) if "norm" in name else torch.randn_like(param) * 0.02)
    batch, context, block_size = 64, 1024, 16
    blocks_per_seq = context // block_size + 1
    cache = KVCache(16, 1 + batch * blocks_per_seq, block_size, 8, 64, torch.bfloat16, torch.device("cuda"))
    block_tables = 1 + torch.arange(batch * blocks_per_seq, device="cuda").view(batch, blocks_per_seq)
    positions = torch.full((batch,), context - 1, dtype=torch.int64, device="cuda")
    slots = block_tables[:, (context - 1) // block_size] * block_size + (context - 1) % block_size
    input_ids = torch.randint(0, 128256, (batch,), device="cuda")
    meta = AttentionMetadata.build(list(range(batch + 1)), [context] * batch, block_tables, slots, positions)

    def step(use_kernels: bool):
        install_ops(model, OPS if use_kernels else None)
        with torch.inference_mode(), forward_context(ForwardContext(cache, meta)):
            return model(input_ids, positions)

    with torch.inference_mode():
        ref_hidden = step(False)
        kernel_hidden = step(True)
        record(
            "e2e hidden (kernels vs torch)",
            f"1B llama b{batch} ctx{context} bf16",
            max_relative_error(kernel_hidden, ref_hidden),
            5e-2,
        )
        torch_ms = time_ms(lambda: step(False), iters=3, warmup=1)
        eager_ms = time_ms(lambda: step(True))
        graphs = DecodeGraphs(model, cache, batch, blocks_per_seq, 8192, torch.device("cuda"))

        class Batch:  # the fields DecodeGraphs reads
            num_tokens = batch
            context_lens = [context] * batch

        Batch.input_ids, Batch.positions, Batch.slot_mapping, Batch.block_tables = (
            input_ids,
            positions,
            slots,
            block_tables,
        )
        graph_hidden = graphs.run(Batch)
        record(
            "e2e hidden (graph vs eager)",
            f"1B llama b{batch} ctx{context} bf16",
            max_relative_error(graph_hidden, kernel_hidden),
            1e-2,
        )
        graph_ms = time_ms(lambda: graphs.run(Batch))
    for label, ms in (
        ("torch references", torch_ms),
        ("kernels, eager", eager_ms),
        ("kernels + CUDA graphs", graph_ms),
    ):
        record(
            f"e2e decode: {label}", f"1B llama b{batch} ctx{context} bf16 (tok/s)", batch / (ms / 1e3), None
        )


def main() -> int:
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device")
        return 1
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__} (CUDA {torch.version.cuda})")
    start = time.perf_counter()
    cuda.load(verbose=False)
    record("build (or cache load)", "rill/kernels/csrc", time.perf_counter() - start, None, "s")
    copy_bytes_per_s = copy_bandwidth()
    record("device copy bandwidth", "1 GiB d2d, read + write", copy_bytes_per_s / 1e9, None, " GB/s")
    for section in (
        check_attention,
        check_norm_rotary,
        lambda: check_decode_bandwidth(copy_bytes_per_s),
        check_end_to_end,
    ):
        try:
            section()
        except Exception as error:  # a crash in one section must not hide the others' results
            global failures
            failures += 1
            ROWS.append((getattr(section, "__name__", "section"), "raised", repr(error)[:60], "", "FAIL"))
            print(f"FAIL {section}: {error!r}", flush=True)
    widths = [
        max(len(row[i]) for row in ROWS + [("check", "shape", "value", "limit", "status")]) for i in range(5)
    ]
    print()
    for row in [("check", "shape", "value", "limit", "status"), *ROWS]:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)))
    print(f"\n{len(ROWS) - failures} passed, {failures} failed ({time.perf_counter() - start:.0f}s)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
