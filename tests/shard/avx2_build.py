"""A pytest plugin (`-p avx2_build`, with tests/shard on the path): the CPU kernels built with -mno-avx512f,
the code an AVX2-only CPU runs, into a cache folder of their own (the build flags are part of its key)."""

from __future__ import annotations

from rill.kernels import cpu

cpu.CFLAGS = (*cpu.CFLAGS, "-mno-avx512f")
cpu.sources.cache_clear()
cpu.load.cache_clear()
if cpu.load().HAS_AVX512:
    raise RuntimeError("the kernels were built with AVX-512 despite -mno-avx512f")
