"""Builds the CUDA kernels into the cache ahead of time (on a machine with a GPU and nvcc).

python -m rill.kernels.build
"""

from __future__ import annotations

import time

import torch

from rill import kernels


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("no CUDA device: nothing to build for (.ci/compile_cuda.py checks the sources)")
    start = time.perf_counter()
    module = kernels.load(verbose=True)
    print(f"built/loaded {module.__file__} in {time.perf_counter() - start:.1f}s")


if __name__ == "__main__":
    main()
