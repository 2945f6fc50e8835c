"""Rill model shard: runs forward passes over a paged KV cache for the Rust router, over gRPC."""
