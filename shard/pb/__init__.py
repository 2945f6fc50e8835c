"""Generated gRPC stubs for proto/shard/v1/shard.proto; regenerate with shard/pb/generate.py."""
