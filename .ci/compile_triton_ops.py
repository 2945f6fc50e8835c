"""CI compile check: every kernel of rill/kernels/triton_ops.py compiles ahead of time, down to a cubin, for
sm_80 and sm_90, in float32, bfloat16 and float16, at the shapes of common models; no GPU needed (Triton's own
ptxas). The kernels' correctness is tests/shard/test_triton_ops.py's (under the interpreter); this proves the
same source also lowers for the GPUs. Exit status 1 on any failure.

    python .ci/compile_triton_ops.py [--archs 80,90]
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import triton
from rill.kernels import triton_ops
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

DTYPES = ("fp32", "bf16", "fp16")


@dataclass(frozen=True)
class Case:
    kernel: Any  # a @triton.jit function of rill.kernels.triton_ops
    label: str
    signature: dict[str, str]  # argument -> Triton type ("*bf16", "i32", "fp32"); constexprs as "constexpr"
    constexprs: dict[str, Any]
    num_warps: int


def _case(kernel: Any, label: str, runtime: dict[str, str], constexprs: dict[str, Any], block: int) -> Case:
    signature = {**runtime, **{name: "constexpr" for name in constexprs}}
    return Case(kernel, label, signature, constexprs, triton_ops._warps(block))


def cases() -> Iterator[Case]:
    """What the launchers launch for the models Rill serves: (kv heads, head_dim), hidden and intermediate
    sizes of SmolLM2, Llama 3 8B / 70B, Qwen2.5, Gemma 2."""
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
    chunk = triton_ops.ROW_CHUNK
    yield Case(
        triton_ops._argmax_rows_kernel,
        "argmax_rows fp32",
        {"out_ptr": "*i64", "x_ptr": "*fp32", "n": "i32", "BLOCK": "constexpr"},
        dict(BLOCK=chunk),
        4,
    )
    yield Case(
        triton_ops._softmax_stats_kernel,
        "softmax_stats fp32",
        {"max_ptr": "*fp32", "log_sum_ptr": "*fp32", "x_ptr": "*fp32", "n": "i32", "BLOCK": "constexpr"},
        dict(BLOCK=chunk),
        4,
    )


def compile_case(case: Case, arch: int) -> int:
    """Compiles one case for sm_<arch>; returns the cubin's size in bytes."""
    source = ASTSource(fn=case.kernel, signature=case.signature, constexprs=case.constexprs)
    options = dict(num_warps=case.num_warps, **triton_ops.LAUNCH_OPTIONS)
    compiled = triton.compile(source, target=GPUTarget("cuda", arch, 32), options=options)
    return len(compiled.asm["cubin"])


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--archs", default="80,90", help="comma-separated SM versions (default: 80,90)")
    args = parser.parse_args()
    failures = total = 0
    start = time.perf_counter()
    for case in cases():
        for arch in (int(a) for a in args.archs.split(",")):
            total += 1
            case_start = time.perf_counter()
            try:
                size = compile_case(case, arch)
            except Exception as error:  # report every case, then fail
                failures += 1
                print(f"FAIL {case.label} sm_{arch}: {error!r}"[:2000])
                continue
            print(
                f"ok   {case.label} sm_{arch}: {size} bytes of cubin, {time.perf_counter() - case_start:.1f}s"
            )
    print(
        f"compile_triton_ops: {total - failures}/{total} compiled for sm_{args.archs} "
        f"in {time.perf_counter() - start:.0f}s"
    )
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
