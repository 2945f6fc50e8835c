"""Generated gRPC stubs for proto/shard/v1/shard.proto; regenerate with proto/generate_python.py."""
