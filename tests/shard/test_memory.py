"""Memory sizing within cgroup limits: the cgroup readers over fake hierarchies (v2, v1, nested, unlimited),
and a real shard process started under a fake cgroup limit sizing both pools within it."""

from __future__ import annotations

import sys
from pathlib import Path

import grpc
import pytest
from rill.shard.memory import available_host_memory, cgroup_room
from rill.shard.pb.shard.v1 import shard_pb2, shard_pb2_grpc
from rill.shard.runner import CPU_KV_MEMORY_FRACTION, SWAP_MEMORY_FRACTION

from bench.servers import spawn, wait_until

from .conftest import make_runner, save_tiny_model

MIB = 2**20


def write_v2(level: Path, limit: str, current_bytes: int, inactive_file_bytes: int = 0) -> None:
    level.mkdir(parents=True, exist_ok=True)
    (level / "memory.max").write_text(f"{limit}\n")
    (level / "memory.current").write_text(f"{current_bytes}\n")
    (level / "memory.stat").write_text(f"anon 1\ninactive_file {inactive_file_bytes}\nactive_file 5\n")


def fake_v2_root(tmp_path: Path) -> Path:
    root = tmp_path / "cgroup"
    root.mkdir()
    (root / "cgroup.controllers").write_text("cpu memory pids\n")
    return root


def self_cgroup(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "self-cgroup"
    path.write_text(text)
    return path


def meminfo(tmp_path: Path, available_bytes: int) -> Path:
    path = tmp_path / "meminfo"
    path.write_text(f"MemTotal: 99999999 kB\nMemAvailable: {available_bytes // 1024} kB\n")
    return path


def test_v2_room_is_limit_minus_usage_without_inactive_page_cache(tmp_path: Path) -> None:
    root = fake_v2_root(tmp_path)
    write_v2(root / "pod", str(512 * MIB), current_bytes=300 * MIB, inactive_file_bytes=100 * MIB)
    room = cgroup_room(root, self_cgroup(tmp_path, "0::/pod\n"))
    assert room is not None and room.room_bytes == 312 * MIB and room.limit_bytes == 512 * MIB


def test_v2_tightest_ancestor_wins_and_max_means_no_limit(tmp_path: Path) -> None:
    root = fake_v2_root(tmp_path)
    write_v2(
        root / "kubepods", str(1024 * MIB), current_bytes=900 * MIB
    )  # 124 MiB left for the whole pod set
    write_v2(root / "kubepods" / "pod", str(512 * MIB), current_bytes=100 * MIB)
    write_v2(root / "kubepods" / "pod" / "container", "max", current_bytes=100 * MIB)
    room = cgroup_room(root, self_cgroup(tmp_path, "0::/kubepods/pod/container\n"))
    assert room is not None and room.room_bytes == 124 * MIB and room.path == root / "kubepods"


def test_v2_container_namespace_path_missing_falls_back_to_the_mount_root(tmp_path: Path) -> None:
    root = fake_v2_root(tmp_path)
    write_v2(root, str(256 * MIB), current_bytes=56 * MIB)
    room = cgroup_room(root, self_cgroup(tmp_path, "0::/host/path/not/mounted\n"))
    assert room is not None and room.room_bytes == 200 * MIB


def test_v1_fallback_and_its_unlimited_value(tmp_path: Path) -> None:
    root = tmp_path / "cgroup"
    level = root / "memory" / "docker" / "abc"
    level.mkdir(parents=True)
    (level / "memory.limit_in_bytes").write_text(f"{300 * MIB}\n")
    (level / "memory.usage_in_bytes").write_text(f"{120 * MIB}\n")
    (level / "memory.stat").write_text(f"inactive_file 1\ntotal_inactive_file {20 * MIB}\n")
    (root / "memory" / "memory.limit_in_bytes").write_text("9223372036854771712\n")  # v1's "no limit"
    (root / "memory" / "memory.usage_in_bytes").write_text(f"{10**12}\n")
    text = "12:pids:/docker/abc\n4:memory:/docker/abc\n0::/\n"  # hybrid: v2 mounted elsewhere
    room = cgroup_room(root, self_cgroup(tmp_path, text))
    assert room is not None and room.room_bytes == 200 * MIB


def test_host_memory_is_the_smaller_of_meminfo_and_the_cgroup(tmp_path: Path) -> None:
    root = fake_v2_root(tmp_path)
    write_v2(root, str(4096 * MIB), current_bytes=1024 * MIB)
    cgroup = self_cgroup(tmp_path, "0::/\n")
    inside = available_host_memory(root, cgroup, meminfo(tmp_path, 24 * 1024 * MIB))
    assert inside.available_bytes == 3072 * MIB and "cgroup" in inside.reason.split("(")[0]
    roomy = available_host_memory(root, cgroup, meminfo(tmp_path, 2048 * MIB))
    assert roomy.available_bytes == 2048 * MIB and roomy.reason.startswith("MemAvailable")
    unlimited = available_host_memory(tmp_path / "none", cgroup, meminfo(tmp_path, 2048 * MIB))
    assert unlimited.available_bytes == 2048 * MIB and "no cgroup memory limit" in unlimited.reason


def test_a_shard_under_a_fake_cgroup_limit_sizes_its_pools_within_it(tmp_path: Path) -> None:
    """The real shard process, its cgroup root pointed at a fake v2 hierarchy whose room (120 MiB) is far
    below this machine's MemAvailable: the KV pool and the default swap pool are the documented shares of
    that room, not of the machine."""
    room_bytes = 120 * MIB
    root = fake_v2_root(tmp_path)
    write_v2(root, str(200 * MIB), current_bytes=100 * MIB, inactive_file_bytes=20 * MIB)
    model_dir = save_tiny_model(tmp_path / "model")
    socket_path = tmp_path / "shard.sock"
    log_path = tmp_path / "shard.log"
    command = [
        sys.executable, "-m", "rill.shard.server", "--model-id", str(model_dir), "--socket", str(socket_path),
        "--num-threads", "1", "--cgroup-root", str(root),
    ]  # fmt: skip
    process = spawn(command, log_path)
    try:
        wait_until(socket_path.exists, process, "shard", log_path, timeout_s=60, poll_s=0.1)
        with grpc.insecure_channel(f"unix://{socket_path}") as channel:
            stub = shard_pb2_grpc.ShardStub(channel)
            request = shard_pb2.WarmupRequest(max_batch_tokens=32, max_batch_size=4, max_total_kv_tokens=0)
            assert not request.HasField("swap_space_bytes")  # unset: the shard sizes the swap pool
            warmup = stub.Warmup(request, timeout=120)
    finally:
        process.terminate()
        process.wait(timeout=30)
    kv_bytes = warmup.num_blocks * warmup.bytes_per_block
    swap_bytes = warmup.num_host_blocks * warmup.bytes_per_block
    assert room_bytes * CPU_KV_MEMORY_FRACTION - warmup.bytes_per_block <= kv_bytes
    assert kv_bytes <= room_bytes * CPU_KV_MEMORY_FRACTION
    swap_share = (room_bytes - kv_bytes) * SWAP_MEMORY_FRACTION
    assert swap_share - warmup.bytes_per_block <= swap_bytes <= swap_share
    assert "cgroup" in warmup.kv_pool_reason and "120.00 GiB" not in warmup.kv_pool_reason
    assert "after the KV pool" in warmup.swap_pool_reason
    assert "KV pool:" in log_path.read_text()


@pytest.mark.parametrize("swap_space_bytes", [0, 64 * 2048])
def test_swap_space_given_wins(tmp_path: Path, swap_space_bytes: int) -> None:
    runner = make_runner(save_tiny_model(tmp_path / "model"), block_size=4, max_total_kv_tokens=64)
    result = runner.warmup(32, 4, 64, swap_space_bytes=swap_space_bytes)
    assert result.num_host_blocks == swap_space_bytes // result.bytes_per_block
    assert result.kv_pool_reason == "router asked for 64 tokens"


MAPPED_ON_THEIR_OWN = """
import ctypes
import sys
import torch
from rill.shard.memory import return_large_frees

class MallInfo2(ctypes.Structure):
    names = "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost"
    _fields_ = [(name, ctypes.c_size_t) for name in names.split()]

mallinfo2 = ctypes.CDLL(None).mallinfo2
mallinfo2.restype = MallInfo2
if sys.argv[1] == "return":
    assert return_large_frees()
torch.empty(4 << 20, dtype=torch.uint8).fill_(1)  # a large block freed: glibc raises its threshold past it
before = mallinfo2().hblkhd
held = [torch.empty(2 << 20, dtype=torch.uint8).fill_(1) for _ in range(8)]
print((mallinfo2().hblkhd - before) >> 20)
"""


@pytest.mark.parametrize("mode", ["keep", "return"])
def test_freed_activations_go_back_to_the_system(mode: str) -> None:
    """glibc serves 2 MiB activations from its heap once a larger block was freed (freed, they stay resident
    unless they happen to end the heap); after `return_large_frees` (what a CPU shard calls at start) each
    is mapped on its own (`mallinfo2().hblkhd`: bytes in such mappings), which freeing unmaps."""
    import subprocess

    script = [sys.executable, "-c", MAPPED_ON_THEIR_OWN, mode]
    mapped_mib = int(subprocess.run(script, capture_output=True, text=True, check=True).stdout)
    assert mapped_mib == (16 if mode == "return" else 0), mapped_mib
