"""Builds Rill's kernels into the cache ahead of time: the CPU kernels always (needs a C++ compiler), the CUDA
kernels when a GPU and nvcc are present.

python -m rill.kernels.build
"""

from __future__ import annotations

import logging
import time

import torch

from rill.kernels.cpu import CpuOps
from rill.kernels.cuda import CudaOps
from rill.kernels.ops import KernelOps


def build(ops: KernelOps) -> None:
    reason = ops.unavailable_reason()
    if reason is not None:
        raise SystemExit(f"cannot build the {ops.name} kernels: {reason}")
    start = time.perf_counter()
    module = ops.load(verbose=ops.name == "cuda")
    print(f"{ops.name} kernels: built/loaded {module.__file__} in {time.perf_counter() - start:.1f}s")


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    build(CpuOps())
    if not torch.cuda.is_available():
        print("cuda kernels: no CUDA device, skipped (.ci/compile_cuda.py checks their sources)")
        return
    build(CudaOps())


if __name__ == "__main__":
    main()
