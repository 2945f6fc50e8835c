"""CI compile check: every Triton kernel Rill runs on a GPU (rill/kernels/triton_attention.py and
rill/kernels/triton_ops.py) compiles ahead of time, down to a cubin, for sm_80 and sm_90, in float32, bfloat16
and float16, at the shapes of common models and the attention's variants (head dims, block sizes, GQA, decode
/ prefill, windows, softcap); no GPU needed (Triton ships ptxas). The 16-bit attention tiles must run their
dots on tensor cores (mma.sync on sm_80, wgmma on sm_90, read from the PTX). The kernels' correctness is the
tests' (tests/shard/test_triton_*.py, under Triton's interpreter); this proves the same source lowers for the
GPUs. Exit status 1 on any failure.

    python .ci/compile_triton.py [--archs 80,90]
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
    sys.exit("compile_triton: unset TRITON_INTERPRET (the interpreter's kernels cannot be compiled)")

import triton  # noqa: E402
from rill.kernels import triton_attention, triton_ops  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

DTYPES = ("fp32", "bf16", "fp16")


@dataclass(frozen=True)
class Case:
    kernel: Any  # a @triton.jit function
    label: str
    signature: dict[str, str]  # argument -> Triton type ("*bf16", "i32", "fp32"); constexprs as "constexpr"
    constexprs: dict[str, Any]
    num_warps: int
    options: dict[str, Any]  # the compile options its launcher passes
    needs_mma: bool = False  # its dots must run on tensor cores


def _case(kernel: Any, label: str, runtime: dict[str, str], constexprs: dict[str, Any], block: int) -> Case:
    signature = {**runtime, **{name: "constexpr" for name in constexprs}}
    return Case(kernel, label, signature, constexprs, triton_ops._warps(block), triton_ops.LAUNCH_OPTIONS)


def op_cases() -> Iterator[Case]:
    """What the launchers launch for the models Rill serves: (kv heads, head_dim), hidden and intermediate
    sizes of SmolLM2, Llama 3 8B / 70B, Qwen2.5, Gemma 2, and LoRA on their projections."""
    next_pow2 = triton.next_power_of_2
    for dtype in DTYPES:
        pointer = f"*{dtype}"
        # (new K/V dtype, pool dtype): the model's, and float32 K/V into a 16-bit pool (one conversion)
        store_dtypes = [(pointer, pointer)] + ([("*fp32", pointer)] if dtype != "fp32" else [])
        for (num_kv_heads, head_dim), (new, pool) in itertools.product(
            ((3, 64), (8, 128), (4, 256)), store_dtypes
        ):
            block_h, block_d = next_pow2(num_kv_heads), next_pow2(head_dim)
            yield _case(
                triton_ops._store_kv_kernel,
                f"store_kv {new[1:]} -> {pool[1:]} kv{num_kv_heads} d{head_dim}",
                {"k_ptr": new, "v_ptr": new, "k_pool_ptr": pool, "v_pool_ptr": pool}
                | {"slot_ptr": "*i64", "num_slots": "i64"}
                | {
                    name: "i32"
                    for name in ("stride_k_token", "stride_k_head", "stride_v_token", "stride_v_head")
                },
                dict(NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, BLOCK_H=block_h, BLOCK_D=block_d),
                block_h * block_d,
            )
        for num_heads, num_kv_heads, head_dim in ((9, 3, 64), (32, 8, 128), (64, 8, 128), (8, 4, 256)):
            half = head_dim // 2
            block_half = next_pow2(half)
            block_h = max(1, min(next_pow2(num_heads), 4096 // block_half))
            yield _case(
                triton_ops._rotary_kernel,
                f"rotary {dtype} h{num_heads}/{num_kv_heads} d{head_dim}",
                {name: pointer for name in ("q_ptr", "k_ptr", "cos_ptr", "sin_ptr")}
                | {
                    name: "i32"
                    for name in ("stride_q_token", "stride_q_head", "stride_k_token", "stride_k_head")
                },
                dict(
                    NUM_HEADS=num_heads,
                    NUM_KV_HEADS=num_kv_heads,
                    HALF=half,
                    BLOCK_H=block_h,
                    BLOCK_HALF=block_half,
                ),
                block_h * block_half,
            )
        for hidden in (576, 4096, 8192):
            for has_residual in (False, True):
                yield _case(
                    triton_ops._fused_add_rms_norm_kernel,
                    f"fused_add_rms_norm {dtype} {hidden}{' +residual' if has_residual else ''}",
                    {
                        name: pointer
                        for name in ("out_ptr", "residual_out_ptr", "x_ptr", "residual_ptr", "weight_ptr")
                    }
                    | {"eps": "fp32"},
                    dict(HIDDEN=hidden, HAS_RESIDUAL=has_residual, BLOCK=next_pow2(hidden)),
                    next_pow2(hidden),
                )
        for intermediate in (1536, 14336):
            block = min(next_pow2(intermediate), 2048)
            yield _case(
                triton_ops._silu_and_mul_kernel,
                f"silu_and_mul {dtype} {intermediate}",
                {"out_ptr": pointer, "x_ptr": pointer},
                dict(INTERMEDIATE=intermediate, BLOCK=block),
                block,
            )
        # LoRA (in, part_ends, R): Llama 3 8B's qkv, o_proj and gate_up, SmolLM2's down.
        for in_features, part_ends, rank in (
            (4096, (4096, 5120, 6144), 16),
            (4096, (4096,), 64),
            (4096, (14336, 28672), 8),
            (1536, (576,), 1),
        ):
            rank_pad, num_parts = next_pow2(rank), len(part_ends)
            shape = f"{dtype} in{in_features} out{part_ends[-1]} P{num_parts} R{rank}"
            yield _case(
                triton_ops._lora_shrink_kernel,
                f"lora shrink {shape}",
                {"h_ptr": "*fp32", "x_ptr": pointer, "a_ptr": pointer, "slot_ptr": "*i32"},
                dict(
                    IN=in_features,
                    RANK=rank,
                    NUM_PARTS=num_parts,
                    RANK_PAD=rank_pad,
                    CHUNK=triton_ops.LORA_CHUNK,
                ),
                rank_pad * triton_ops.LORA_CHUNK,
            )
            yield _case(
                triton_ops._lora_expand_kernel,
                f"lora expand {shape}",
                {"y_ptr": pointer, "h_ptr": "*fp32", "b_ptr": pointer, "slot_ptr": "*i32"}
                | {"end0": "i32", "end1": "i32"},
                dict(
                    OUT=part_ends[-1],
                    RANK=rank,
                    NUM_PARTS=num_parts,
                    RANK_PAD=rank_pad,
                    BLOCK=triton_ops.LORA_OUTPUTS,
                ),
                rank_pad * triton_ops.LORA_OUTPUTS,
            )
    chunk = triton_ops.ROW_CHUNK
    yield Case(
        triton_ops._argmax_rows_kernel,
        "argmax_rows fp32",
        {"out_ptr": "*i64", "x_ptr": "*fp32", "n": "i32", "BLOCK": "constexpr"},
        dict(BLOCK=chunk),
        4,
        triton_ops.LAUNCH_OPTIONS,
    )
    yield Case(
        triton_ops._softmax_stats_kernel,
        "softmax_stats fp32",
        {"max_ptr": "*fp32", "log_sum_ptr": "*fp32", "x_ptr": "*fp32", "n": "i32", "BLOCK": "constexpr"},
        dict(BLOCK=chunk),
        4,
        triton_ops.LAUNCH_OPTIONS,
    )


# Per argument of the attention kernels that is neither an int nor a constexpr ("pool": the pools' dtype).
ATTENTION_POINTERS = {
    "out": "pool",
    "q_ptr": "pool",
    "k_pool": "pool",
    "v_pool": "pool",
    "part_acc": "*fp32",
    "part_ml": "*fp32",
    "block_tables": "*i64",
    "cu_seqlens_q": "*i32",
    "context_lens": "*i32",
    "positions": "*i64",
}


def _attention_signature(kernel: Any, dtype: str, constexprs: dict[str, Any]) -> dict[str, str]:
    """Every argument's Triton type: pool pointers in `dtype`, the others as the wrapper passes them (int
    arguments as i32)."""
    types = {}
    for name in kernel.arg_names:
        if name in constexprs:
            types[name] = "constexpr"
        elif name in ATTENTION_POINTERS:
            kind = ATTENTION_POINTERS[name]
            types[name] = f"*{dtype}" if kind == "pool" else kind
        else:
            types[name] = "fp32" if name in ("scale", "softcap") else "i32"
    return types


def attention_cases() -> Iterator[Case]:
    """Each dtype, head dims 64 / 80 / 128 / 256, block sizes 8 / 16 / 32, GQA 1 / 2 / 4 / 8, decode (with its
    merge) and prefill, with and without window and softcap."""
    tiles, merge = triton_attention._paged_attention_tiles, triton_attention._merge_decode_splits
    for dtype, head_dim, block_size, group, decode, window, softcap in [
        ("bf16", 128, 16, 4, True, False, False),
        ("bf16", 128, 16, 4, False, True, True),
        ("fp16", 64, 8, 1, False, False, False),
        ("fp16", 80, 32, 8, True, True, False),
        ("fp32", 64, 32, 8, False, False, True),
        ("bf16", 256, 16, 2, False, True, False),
        ("bf16", 256, 32, 8, True, False, True),
    ]:
        block_m, block_n, num_warps = triton_attention.tile_sizes(head_dim)
        head_dim_pad = triton.next_power_of_2(head_dim)
        constexprs: dict[str, Any] = dict(
            GROUP=group,
            HEAD_DIM=head_dim,
            HEAD_DIM_PAD=head_dim_pad,
            BLOCK_M=block_m,
            BLOCK_N=block_n,
            BLOCK_SIZE=block_size,
            SPLIT_KEYS=triton_attention.SPLIT_KEYS,
            SPLIT_OUTPUT=decode,
            USE_SOFTCAP=softcap,
            USE_WINDOW=window,
            DOT_PRECISION="ieee" if dtype == "fp32" else "tf32",
        )
        label = (
            f"attention tiles {dtype} d{head_dim} bs{block_size} g{group} "
            f"{'decode' if decode else 'prefill'}{' window' * window}{' softcap' * softcap}"
        )
        signature = _attention_signature(tiles, dtype, constexprs)
        yield Case(tiles, label, signature, constexprs, num_warps, {}, needs_mma=dtype != "fp32")
        if decode:
            merge_constexprs: dict[str, Any] = dict(
                HEAD_DIM=head_dim,
                HEAD_DIM_PAD=head_dim_pad,
                HEADS_PAD=triton.next_power_of_2(group * 8),
                SPLIT_KEYS=triton_attention.SPLIT_KEYS,
                USE_WINDOW=window,
            )
            signature = _attention_signature(merge, dtype, merge_constexprs)
            yield Case(merge, f"attention merge {dtype} d{head_dim}", signature, merge_constexprs, 4, {})


def compile_case(case: Case, arch: int) -> str:
    """Compiles one case for sm_<arch>; returns what it became (cubin size, tensor-core instructions)."""
    source = ASTSource(fn=case.kernel, signature=case.signature, constexprs=case.constexprs)
    options = dict(num_warps=case.num_warps, **case.options)
    compiled = triton.compile(source, target=GPUTarget("cuda", arch, 32), options=options)
    cubin = compiled.asm["cubin"]
    mma = "wgmma.mma_async" if arch >= 90 else "mma.sync"
    num_mma = compiled.asm["ptx"].count(mma)
    if case.needs_mma and not num_mma:
        raise RuntimeError(f"no {mma} in the PTX: the dots do not run on tensor cores")
    return f"{len(cubin)} bytes of cubin" + (f", {num_mma} {mma}" if case.needs_mma else "")


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--archs", default="80,90", help="comma-separated SM versions (default: 80,90)")
    args = parser.parse_args()
    failures = total = 0
    start = time.perf_counter()
    for case in itertools.chain(op_cases(), attention_cases()):
        for arch in (int(a) for a in args.archs.split(",")):
            total += 1
            case_start = time.perf_counter()
            try:
                what = compile_case(case, arch)
            except Exception as error:  # report every case, then fail
                failures += 1
                print(f"FAIL {case.label} sm_{arch}: {error!r}"[:2000])
                continue
            print(f"ok   {case.label} sm_{arch}: {what}, {time.perf_counter() - case_start:.1f}s")
    print(
        f"compile_triton: {total - failures}/{total} compiled for sm_{args.archs} "
        f"in {time.perf_counter() - start:.0f}s"
    )
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
