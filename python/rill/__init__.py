"""Rill: an LLM serving system. `python -m rill --help` starts here.

Subpackages: `rill.launcher` (starts and supervises the shards and the router), `rill.shard` (the Python model
shard behind the router's gRPC calls), `rill.kernels` (one kernel interface, its CPU and CUDA implementations
and their build). The router is the `rill-router` binary installed beside this package.
"""
