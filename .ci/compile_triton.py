"""CI compile check: every Triton kernel of rill/kernels/triton_attention.py compiles ahead of time, down to a
cubin, for sm_80 and sm_90 with representative constexprs (dtypes, head dims, decode / prefill, windows,
softcap); no GPU needed (Triton ships ptxas). Exit status 1 on any compile error.

    python .ci/compile_triton.py [--archs 80,90]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback

if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
    sys.exit("compile_triton: unset TRITON_INTERPRET (the interpreter's kernels cannot be compiled)")

import torch  # noqa: E402
import triton  # noqa: E402
from rill.kernels import triton_attention as ta  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402

TRITON_TYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
# Per argument of `_paged_attention_tiles` / `_merge_decode_splits` that is neither an int nor a constexpr.
POINTERS = {
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
FLOATS = {"scale", "softcap"}


def signature(
    kernel: triton.JITFunction, dtype: torch.dtype, constexprs: dict[str, object]
) -> dict[str, str]:
    """Every argument's Triton type: pool pointers in `dtype`, the others as the wrapper passes them (int
    arguments as i32)."""
    types = {}
    for name in kernel.arg_names:
        if name in constexprs:
            types[name] = "constexpr"
        elif name in POINTERS:
            kind = POINTERS[name]
            types[name] = f"*{TRITON_TYPES[dtype]}" if kind == "pool" else kind
        elif name in FLOATS:
            types[name] = "fp32"
        else:
            types[name] = "i32"
    return types


def variants() -> list[tuple[str, triton.JITFunction, torch.dtype, dict[str, object], int]]:
    """(label, kernel, pool dtype, constexprs, warps): each dtype, head dims 64 / 80 / 128 / 256, block sizes
    8 / 16 / 32, GQA 1 / 4 / 8, decode and prefill, with and without window and softcap."""
    out = []
    for dtype, head_dim, block_size, group, decode, window, softcap in [
        (torch.bfloat16, 128, 16, 4, True, False, False),
        (torch.bfloat16, 128, 16, 4, False, True, True),
        (torch.float16, 64, 8, 1, False, False, False),
        (torch.float16, 80, 32, 8, True, True, False),
        (torch.float32, 64, 32, 8, False, False, True),
        (torch.bfloat16, 256, 16, 2, False, True, False),
        (torch.bfloat16, 256, 32, 8, True, False, True),
    ]:
        block_m, block_n, num_warps = ta.tile_sizes(head_dim)
        constexprs: dict[str, object] = dict(
            GROUP=group,
            HEAD_DIM=head_dim,
            HEAD_DIM_PAD=triton.next_power_of_2(head_dim),
            BLOCK_M=block_m,
            BLOCK_N=block_n,
            BLOCK_SIZE=block_size,
            SPLIT_KEYS=ta.SPLIT_KEYS,
            SPLIT_OUTPUT=decode,
            USE_SOFTCAP=softcap,
            USE_WINDOW=window,
            DOT_PRECISION="ieee" if dtype == torch.float32 else "tf32",
        )
        label = (
            f"tiles {TRITON_TYPES[dtype]} d{head_dim} bs{block_size} g{group} "
            f"{'decode' if decode else 'prefill'}{' window' * window}{' softcap' * softcap}"
        )
        out.append((label, ta._paged_attention_tiles, dtype, constexprs, num_warps))
        if decode:
            merge = dict(
                HEAD_DIM=head_dim,
                HEAD_DIM_PAD=triton.next_power_of_2(head_dim),
                HEADS_PAD=triton.next_power_of_2(group * 8),
                SPLIT_KEYS=ta.SPLIT_KEYS,
                USE_WINDOW=window,
            )
            out.append((f"merge {TRITON_TYPES[dtype]} d{head_dim}", ta._merge_decode_splits, dtype, merge, 4))
    return out


def compile_all(archs: list[int]) -> int:
    """Compiles every variant for every arch; returns the number of failures."""
    failures = 0
    for arch in archs:
        target = GPUTarget("cuda", arch, 32)
        for label, kernel, dtype, constexprs, num_warps in variants():
            start = time.perf_counter()
            try:
                source = triton.compiler.ASTSource(
                    fn=kernel, signature=signature(kernel, dtype, constexprs), constexprs=constexprs
                )
                compiled = triton.compile(source, target=target, options={"num_warps": num_warps})
                cubin = compiled.asm.get("cubin", b"")
                if not cubin:
                    raise RuntimeError("no cubin")
                # Tensor cores: the tiles' dots must become mma.sync (sm_80) / wgmma (sm_90) for 16-bit pools.
                mma = "wgmma.mma_async" if arch >= 90 else "mma.sync"
                uses_mma = compiled.asm["ptx"].count(mma)
                if kernel is ta._paged_attention_tiles and dtype != torch.float32 and not uses_mma:
                    raise RuntimeError(f"no {mma} in the PTX: the dots do not run on tensor cores")
                seconds = time.perf_counter() - start
                print(
                    f"ok   sm_{arch} {label}: {len(cubin)} bytes of cubin, {uses_mma} {mma}, {seconds:.1f}s"
                )
            except Exception:
                failures += 1
                print(f"FAIL sm_{arch} {label}:\n{traceback.format_exc()}")
    return failures


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--archs", default="80,90", help="comma-separated SM versions (default: 80,90)")
    args = parser.parse_args()
    failures = compile_all([int(a) for a in args.archs.split(",")])
    print(f"compile_triton: {failures} failure(s), Triton {triton.__version__}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
