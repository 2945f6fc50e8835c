"""Rill's kernels: one interface (`rill.kernels.ops.KernelOps`, with the `AttentionMetadata` every backend
reads), implemented per device by `rill.kernels.cpu.CpuOps` and `rill.kernels.cuda.CudaOps`, each built and
cached by `rill.kernels.extension`. Kernels sit below the shard: nothing here imports rill.shard.
"""
