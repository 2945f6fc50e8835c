"""Rill's kernels: one interface (`rill.kernels.ops.KernelOps`, with the `AttentionMetadata` every backend
reads), implemented per device by `rill.kernels.cpu.CpuOps` (C++, built and cached by
`rill.kernels.extension`) and `rill.kernels.gpu.GpuOps` (Triton, compiled by Triton on first use). Kernels sit
below the shard: nothing here imports rill.shard.
"""
