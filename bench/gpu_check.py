"""The one GPU check of Rill's GPU kernels (rill.kernels.gpu.GpuOps, Triton): correctness against the torch
references on the GPU, timings against what the device can do, FlashInfer on the same shapes, end to end.

    python -m bench.gpu_check            (a few minutes on one H100/H200-class GPU; exit 1 on any FAIL)

Nothing is built: Triton compiles each kernel on its first call (the first section's time includes that).
Correctness: every op against its shard reference on fresh random data (attention: block sizes 16/32, head
dims 64/128/256, GQA 1..8, contexts 1..32k, batch 1..256, sliding windows and soft-capping, outputs landing on
NaN-poisoned memory); relative error (max |a - e| / max |e|) <= 1e-2 for bf16/fp16, <= 1e-5 for fp32;
store_kv, rotary and argmax bitwise. Timing: CUDA events, medians. Anchors, measured here first: a
device-to-device copy (bytes/s) and a dense bf16 matmul (FLOP/s). Decode attention must read its K/V at >= 80%
of the copy rate (batch 64 x 4k context); prefill attention's FLOP/s and the elementwise kernels' bytes/s are
reported as fractions of the anchors, next to FlashInfer's decode and prefill where `flashinfer` imports. End
to end: decode steps/s of a 1B-class Llama (random weights, bf16), torch references vs kernels, without and
with CUDA graphs.
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable

import torch
from rill.kernels.gpu import GpuOps
from rill.kernels.ops import AttentionMetadata
from rill.shard.layers.activation import SiluAndMul
from rill.shard.layers.attention import ForwardContext, forward_context
from rill.shard.layers.backend import install_ops
from rill.shard.layers.norm import RMSNorm
from rill.shard.layers.rotary import RotaryEmbedding
from rill.shard.sampling import first_argmax, softmax_stats

from bench.kernel_cases import (
    AttentionCase,
    make_case,
    max_relative_error,
    run_attention,
    run_attention_poisoned,
)

OPS = GpuOps()
TOLERANCE = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 1e-2}
NAME = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}
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
    print(f"{status:4} {check:30} {shape:52} {value:.3g}{unit}", flush=True)


def time_ms(fn: Callable[[], object], iters: int = 20, warmup: int = 3) -> float:
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


def dense_bf16_rate() -> float:
    """FLOP/s of an 8192^3 bf16 matmul (torch's cuBLAS)."""
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    ms = time_ms(lambda: a @ b, iters=10)
    return 2 * 8192**3 / (ms / 1e3)


def attention_error(case: AttentionCase, sliding_window: int = 0, softcap: float = 0.0) -> tuple[float, bool]:
    """(max relative error of the kernels against the reference, whether store_kv left the pools bitwise the
    reference's)."""
    expected, k_ref, v_ref = run_attention(case, None, sliding_window=sliding_window, softcap=softcap)
    actual, k_out, v_out = run_attention(case, OPS, sliding_window=sliding_window, softcap=softcap)
    error = max_relative_error(actual, expected)
    if not sliding_window and not softcap:
        error = max(error, max_relative_error(run_attention_poisoned(case, OPS), expected))
    same_pool = torch.equal(k_out.nan_to_num(3.0), k_ref.nan_to_num(3.0)) and torch.equal(
        v_out.nan_to_num(3.0), v_ref.nan_to_num(3.0)
    )
    return error, same_pool


def check_attention() -> None:
    randint = torch.randint
    decode_cases = [  # (batch contexts, heads, kv heads, head_dim, block size, dtype)
        ([1, 2, 15, 16, 17, 255, 256, 257, 1000], 8, 8, 64, 16, torch.bfloat16),
        ([32768], 32, 8, 128, 16, torch.bfloat16),
        ([32768, 1, 4097], 32, 4, 64, 32, torch.float16),
        (randint(1, 513, (256,), generator=torch.Generator().manual_seed(1)).tolist(), 32, 8, 64, 16,
         torch.bfloat16),
        (randint(1, 4097, (64,), generator=torch.Generator().manual_seed(2)).tolist(), 32, 4, 128, 32,
         torch.bfloat16),
        ([1, 100, 3000, 9000], 16, 2, 128, 32, torch.float32),
        ([7, 700], 8, 1, 64, 16, torch.float32),
        ([5, 600, 2000], 8, 4, 256, 16, torch.bfloat16),
    ]  # fmt: skip
    for seed, (contexts, heads, kv_heads, head_dim, block_size, dtype) in enumerate(decode_cases):
        case = make_case(
            [1] * len(contexts), contexts, heads, kv_heads, head_dim, block_size, dtype, seed=seed
        )
        shape = f"b{len(contexts)} ctx<={max(contexts)} h{heads}/{kv_heads} d{head_dim} bs{block_size}"
        shape += f" {NAME[dtype]}"
        error, same_pool = attention_error(case)
        record("decode attention", shape[:52], error, TOLERANCE[dtype])
        record("store_kv (pool == ref)", shape[:52], 0.0 if same_pool else 1.0, 0.0)
    prefill_cases = [  # (query lens, contexts, heads, kv heads, head_dim, block size, dtype)
        ([1000], [1000], 32, 8, 64, 16, torch.bfloat16),
        ([512, 37, 1, 1, 200], [512, 4133, 9, 32768, 1200], 32, 4, 128, 32, torch.bfloat16),
        ([64, 1, 300], [2000, 1, 300], 8, 8, 128, 16, torch.float16),
        ([33, 128, 1], [500, 128, 77], 16, 2, 64, 16, torch.float32),
        ([100, 1], [300, 900], 8, 2, 256, 16, torch.bfloat16),
    ]
    for seed, (query_lens, contexts, heads, kv_heads, head_dim, block_size, dtype) in enumerate(
        prefill_cases
    ):
        case = make_case(query_lens, contexts, heads, kv_heads, head_dim, block_size, dtype, seed=100 + seed)
        error, _ = attention_error(case)
        shape = f"q{query_lens} ctx<={max(contexts)} h{heads}/{kv_heads} d{head_dim} {NAME[dtype]}"
        record("prefill attention", shape[:52], error, TOLERANCE[dtype])
    # Sliding windows (Mistral, Gemma 2 local layers) and soft-capping (Gemma 2), decode and mixed batches.
    for seed, (query_lens, contexts, window, softcap) in enumerate(
        [([1] * 4, [10, 500, 4096, 9000], 256, 0.0), ([200, 1, 40], [200, 3000, 5000], 128, 50.0),
         ([1, 1], [4000, 33], 0, 30.0)]
    ):  # fmt: skip
        case = make_case(query_lens, contexts, 16, 8, 128, 16, torch.bfloat16, seed=200 + seed)
        error, _ = attention_error(case, window, softcap)
        shape = f"q{query_lens} ctx<={max(contexts)} window {window} softcap {softcap:g} bf16"
        record("attention window/softcap", shape[:52], error, TOLERANCE[torch.bfloat16])


def check_ops() -> None:
    """The ops outside attention, on the GPU against their references."""
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        torch.manual_seed(0)
        norm = RMSNorm(2048, 1e-5).to(dtype).cuda()
        norm.weight.data = torch.randn(2048, device="cuda").to(dtype)
        x = torch.randn(257, 2048, device="cuda").to(dtype)
        residual = torch.randn(257, 2048, device="cuda").to(dtype)
        expected, expected_residual = norm(x, residual)
        norm.use_ops(OPS)
        actual, actual_residual = norm(x, residual)
        record(
            "fused add + RMSNorm",
            f"257x2048 {NAME[dtype]}",
            max_relative_error(actual, expected),
            TOLERANCE[dtype],
        )
        record(
            "  residual sum (bitwise)",
            f"257x2048 {NAME[dtype]}",
            float(not torch.equal(actual_residual, expected_residual)),
            0.0,
        )
        for head_dim in (64, 128, 256):
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
            same = (
                torch.equal(out[:, : 32 * head_dim].view(300, 32, head_dim), q_ref)
                and torch.equal(out[:, 32 * head_dim : 40 * head_dim].view(300, 8, head_dim), k_ref)
                and torch.equal(out[:, 40 * head_dim :], qkv[:, 40 * head_dim :])
            )
            record(
                "rotary (bitwise, in place)", f"300 tok h32/8 d{head_dim} {NAME[dtype]}", float(not same), 0.0
            )
        x = torch.randn(257, 2 * 8192, device="cuda").to(dtype) * 4
        layer = SiluAndMul()
        expected = layer(x)
        layer.use_ops(OPS)
        record(
            "silu_and_mul",
            f"257x2x8192 {NAME[dtype]}",
            max_relative_error(layer(x), expected),
            TOLERANCE[dtype],
        )
    logits = torch.randn(64, 151936, device="cuda") * 5
    logits[1] = float("-inf")
    logits[2, [7, 150000]] = 50.0
    logits[3, 100000] = float("nan")
    same = torch.equal(first_argmax(logits, OPS), logits.max(dim=-1).indices)
    record("argmax_rows (bitwise)", "64x151936 fp32", float(not same), 0.0)
    logits[1] = torch.randn(151936, device="cuda")
    logits[3, 100000] = 0.0
    row_max, log_sum = softmax_stats(logits, OPS)
    log_probs = (logits - row_max[:, None]) - log_sum[:, None]
    record(
        "softmax_stats (log-softmax)",
        "64x151936 fp32",
        max_relative_error(log_probs, logits.log_softmax(-1)),
        1e-5,
    )


def attention_ms(case: AttentionCase, k_pool: torch.Tensor, v_pool: torch.Tensor, iters: int = 20) -> float:
    meta = case.metadata()
    return time_ms(lambda: OPS.paged_attention(case.q, k_pool, v_pool, meta, case.scale), iters=iters)


def check_timings(copy_bytes_per_s: float, bf16_flops: float) -> None:
    """Attention against the anchors (and FlashInfer), the elementwise kernels against the copy rate."""
    for heads, kv_heads, head_dim in ((32, 8, 64), (32, 8, 128)):
        case = make_case([1] * 64, [4096] * 64, heads, kv_heads, head_dim, 16, torch.bfloat16, seed=7)
        k_pool, v_pool = case.k_pool.nan_to_num(0.0), case.v_pool.nan_to_num(0.0)
        ms = attention_ms(case, k_pool, v_pool)
        kv_bytes = 2 * 64 * 4096 * kv_heads * head_dim * 2
        shape = f"b64 x 4096 h{heads}/{kv_heads} d{head_dim} bf16 ({ms * 1e3:.0f} us)"
        record("decode attention / copy", shape, kv_bytes / (ms / 1e3) / copy_bytes_per_s, 0.8, higher=True)
        compare(flashinfer_decode, case, k_pool, v_pool, kv_bytes, copy_bytes_per_s)
    for query_len, heads, kv_heads, head_dim in ((4096, 32, 8, 128), (8192, 32, 8, 64)):
        case = make_case([query_len], [query_len], heads, kv_heads, head_dim, 16, torch.bfloat16, seed=8)
        k_pool, v_pool = case.k_pool.nan_to_num(0.0), case.v_pool.nan_to_num(0.0)
        ms = attention_ms(case, k_pool, v_pool, iters=10)
        flops = 4 * heads * head_dim * query_len * (query_len + 1) / 2  # causal: QK^T and PV over half
        shape = f"1 x {query_len} causal h{heads}/{kv_heads} d{head_dim} bf16 ({ms:.2f} ms)"
        record("prefill attention / dense bf16", shape, flops / (ms / 1e3) / bf16_flops, None)
        compare(flashinfer_prefill, case, k_pool, v_pool, flops, bf16_flops)
    rows, hidden = 256, 4096
    x = torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16)
    residual, weight = torch.randn_like(x), torch.randn(hidden, device="cuda", dtype=torch.bfloat16)
    gate_up = torch.cat([x, residual], dim=1)
    elementwise = [  # (name, call, bytes moved)
        ("fused add + RMSNorm", lambda: OPS.fused_add_rms_norm(x, residual, weight, 1e-5), 4 * x.numel() * 2),
        ("silu_and_mul", lambda: OPS.silu_and_mul(gate_up), 3 * x.numel() * 2),
    ]
    q, k = (
        torch.randn(rows, 32, 128, device="cuda", dtype=torch.bfloat16),
        torch.randn(rows, 8, 128, device="cuda", dtype=torch.bfloat16),
    )
    cos, sin = (
        torch.randn(rows, 64, device="cuda", dtype=torch.bfloat16),
        torch.randn(rows, 64, device="cuda", dtype=torch.bfloat16),
    )
    elementwise.append(
        ("rotary", lambda: OPS.rotary_embedding(q, k, cos, sin), 2 * (q.numel() + k.numel()) * 2)
    )
    k_pool = torch.zeros(4096, 16, 8, 128, device="cuda", dtype=torch.bfloat16)
    slots = torch.randperm(4096 * 16, device="cuda")[:rows]
    elementwise.append(("store_kv", lambda: OPS.store_kv(k, k, k_pool, k_pool, slots), 4 * k.numel() * 2))
    logits = torch.randn(64, 151936, device="cuda")
    elementwise.append(("argmax_rows", lambda: OPS.argmax_rows(logits), logits.numel() * 4))
    elementwise.append(("softmax_stats", lambda: OPS.softmax_stats(logits), 2 * logits.numel() * 4))
    for name, call, num_bytes in elementwise:
        ms = time_ms(call)
        record(
            f"{name} / copy",
            f"{rows} tokens, Llama-8B shapes ({ms * 1e3:.0f} us)",
            num_bytes / (ms / 1e3) / copy_bytes_per_s,
            None,
        )


def compare(flashinfer_timing: Callable[..., None], *args: object) -> None:
    """A FlashInfer timing, for comparison only: its failure (an API that moved) is a row, not a FAIL."""
    try:
        flashinfer_timing(*args)
    except Exception as error:
        ROWS.append((f"  {flashinfer_timing.__name__}", "raised", repr(error)[:60], "", "info"))
        print(f"info {flashinfer_timing.__name__} raised {error!r}", flush=True)


def _flashinfer_pages(case: AttentionCase) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(indptr, indices, last page lengths), int32, of the case's block tables."""
    block_size = case.k_pool.shape[1]
    num_pages = [-(-n // block_size) for n in case.context_lens]
    indices = torch.cat([case.block_tables[i, :n] for i, n in enumerate(num_pages)]).int()
    indptr = torch.tensor([0, *torch.tensor(num_pages).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    last = torch.tensor(
        [(n - 1) % block_size + 1 for n in case.context_lens], dtype=torch.int32, device="cuda"
    )
    return indptr, indices, last


def flashinfer_decode(
    case: AttentionCase, k_pool: torch.Tensor, v_pool: torch.Tensor, kv_bytes: int, copy: float
) -> None:
    try:
        import flashinfer
    except ImportError:
        return
    _, block_size, kv_heads, head_dim = k_pool.shape
    workspace = torch.empty(256 * 2**20, dtype=torch.uint8, device="cuda")
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD")
    wrapper.plan(*_flashinfer_pages(case), case.q.shape[1], kv_heads, head_dim, block_size,
                 q_data_type=case.q.dtype, kv_data_type=k_pool.dtype, sm_scale=case.scale)  # fmt: skip
    ms = time_ms(lambda: wrapper.run(case.q, (k_pool, v_pool)))
    record(
        "  FlashInfer decode / copy", f"same shape ({ms * 1e3:.0f} us)", kv_bytes / (ms / 1e3) / copy, None
    )


def flashinfer_prefill(
    case: AttentionCase, k_pool: torch.Tensor, v_pool: torch.Tensor, flops: float, rate: float
) -> None:
    try:
        import flashinfer
    except ImportError:
        return
    _, block_size, kv_heads, head_dim = k_pool.shape
    workspace = torch.empty(256 * 2**20, dtype=torch.uint8, device="cuda")
    wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD")
    qo_indptr = torch.tensor(case.cu_seqlens_q, dtype=torch.int32, device="cuda")
    wrapper.plan(qo_indptr, *_flashinfer_pages(case), case.q.shape[1], kv_heads, head_dim, block_size,
                 causal=True, q_data_type=case.q.dtype, kv_data_type=k_pool.dtype,
                 sm_scale=case.scale)  # fmt: skip
    ms = time_ms(lambda: wrapper.run(case.q, (k_pool, v_pool)), iters=10)
    record("  FlashInfer prefill / dense", f"same shape ({ms:.2f} ms)", flops / (ms / 1e3) / rate, None)


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

    def step(use_kernels: bool) -> torch.Tensor:
        install_ops(model, OPS if use_kernels else None)
        with torch.inference_mode(), forward_context(ForwardContext(cache, meta)):
            return model(input_ids, positions)

    shape = f"1B llama b{batch} ctx{context} bf16"
    with torch.inference_mode():
        ref_hidden = step(False)
        kernel_hidden = step(True)
        record("e2e hidden (kernels vs torch)", shape, max_relative_error(kernel_hidden, ref_hidden), 5e-2)
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
        record("e2e hidden (graph vs eager)", shape, max_relative_error(graph_hidden, kernel_hidden), 1e-2)
        graph_ms = time_ms(lambda: graphs.run(Batch))
    for label, ms in (
        ("torch references", torch_ms),
        ("kernels, eager", eager_ms),
        ("kernels + CUDA graphs", graph_ms),
    ):
        record(f"e2e decode: {label}", f"{shape} (tok/s)", batch / (ms / 1e3), None)


def main() -> int:
    global failures
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device")
        return 1
    import triton

    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__} (CUDA {torch.version.cuda}), "
          f"triton {triton.__version__}")  # fmt: skip
    start = time.perf_counter()
    copy_bytes_per_s = copy_bandwidth()
    record("device copy bandwidth", "1 GiB d2d, read + write", copy_bytes_per_s / 1e9, None, " GB/s")
    bf16_flops = dense_bf16_rate()
    record("dense bf16 matmul", "8192^3 (cuBLAS)", bf16_flops / 1e12, None, " TFLOP/s")
    for section in (
        check_ops,
        check_attention,
        lambda: check_timings(copy_bytes_per_s, bf16_flops),
        check_end_to_end,
    ):
        try:
            section()
        except Exception as error:  # a crash in one section must not hide the others' results
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
