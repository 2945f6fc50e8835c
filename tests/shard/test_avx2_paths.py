"""The CPU kernels' AVX2 paths on a CPU with AVX-512. -march=native compiles one path per kernel for the CPU
at hand, so an AVX-512 host would never run the code an AVX2-only CPU runs; here the kernels are built again
without AVX-512 (tests/shard/avx2_build.py) and their tests, which compare every path with its reference and
with the portable C++ bitwise, run on that build in a subprocess."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from rill.kernels import cpu as cpu_kernels

HERE = Path(__file__).resolve().parent
KERNEL_TESTS = ("test_cpu_kernels.py", "test_cpu_linear.py", "test_quant_kernels.py", "test_kv_int8.py")


def test_the_kernel_tests_pass_on_the_avx2_build() -> None:
    if not cpu_kernels.load().HAS_AVX512:
        pytest.skip("this CPU has no AVX-512: the kernel tests themselves run its AVX2 paths")
    path = os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")]))
    tests = [str(HERE / name) for name in KERNEL_TESTS]
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "avx2_build", *tests],
        env=dict(os.environ, PYTHONPATH=path),
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert " passed" in result.stdout.splitlines()[-1], result.stdout[-2000:]
