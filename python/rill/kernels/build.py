"""Builds Rill's kernels into the cache ahead of time: the CPU kernels always (needs a C++ compiler), the CUDA
kernels when a GPU and nvcc are present.

python -m rill.kernels.build
"""

from __future__ import annotations

import logging
import time

import torch

from rill import kernels
from rill.kernels import cpu


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    reason = cpu.unavailable_reason()
    if reason is not None:
        raise SystemExit(f"cannot build the CPU kernels: {reason}")
    start = time.perf_counter()
    module = cpu.load()
    print(f"CPU kernels: built/loaded {module.__file__} in {time.perf_counter() - start:.1f}s")
    if not torch.cuda.is_available():
        print("CUDA kernels: no CUDA device, skipped (.ci/compile_cuda.py checks their sources)")
        return
    start = time.perf_counter()
    module = kernels.load(verbose=True)
    print(f"CUDA kernels: built/loaded {module.__file__} in {time.perf_counter() - start:.1f}s")


if __name__ == "__main__":
    main()
