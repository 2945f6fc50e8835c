"""Builds Rill's CPU kernels into the cache ahead of time (needs a C++ compiler). The GPU kernels are Triton's
to compile, per shape on first use: nothing to build for them here.

python -m rill.kernels.build
"""

from __future__ import annotations

import logging
import time

from rill.kernels.cpu import CpuOps
from rill.kernels.ops import KernelOps


def build(ops: KernelOps) -> None:
    reason = ops.unavailable_reason()
    if reason is not None:
        raise SystemExit(f"cannot build the {ops.name} kernels: {reason}")
    start = time.perf_counter()
    module = ops.load()
    print(f"{ops.name} kernels: built/loaded {module.__file__} in {time.perf_counter() - start:.1f}s")


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    build(CpuOps())
    print("cuda kernels (Triton): compiled by Triton on first use, nothing to build ahead of time")


if __name__ == "__main__":
    main()
