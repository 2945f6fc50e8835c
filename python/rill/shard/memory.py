"""How much host memory this process may still use: the smaller of /proc/meminfo's MemAvailable and the room
left under its cgroup's memory limit (v2 `memory.max`, v1 `memory.limit_in_bytes`, every ancestor's too); and
how freed host memory goes back to the system.

Inside a container /proc/meminfo describes the whole node, not the pod: sizing from it alone gets a pod
OOM-killed. A cgroup's room is its limit minus the memory charged to it that cannot simply be dropped
(usage minus inactive page cache, as the kubelet counts its working set).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
UNLIMITED_BYTES = 1 << 60  # cgroup v1 writes "no limit" as a huge page-aligned number
M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter (malloc.h)
RETURNED_ALLOCATION_BYTES = 1 << 20


def return_large_frees(threshold_bytes: int = RETURNED_ALLOCATION_BYTES) -> bool:
    """Has the C library map every allocation of `threshold_bytes` or more on its own, so that freeing it
    returns it to the system. glibc otherwise raises that threshold as large blocks are freed (up to 32 MiB)
    and keeps a step's freed activations resident after it: on the default model at 16 clients, 89 MiB kept
    after the workload. False where the C library has no `mallopt` (not glibc)."""
    mallopt = getattr(ctypes.CDLL(None), "mallopt", None)
    return mallopt is not None and mallopt(M_MMAP_THRESHOLD, threshold_bytes) == 1


@dataclass(frozen=True)
class HostMemory:
    """Bytes this process may still allocate, and where that figure comes from (for logs and /info)."""

    available_bytes: int
    reason: str


@dataclass(frozen=True)
class _CgroupRoom:
    room_bytes: int
    limit_bytes: int
    path: Path


def available_host_memory(
    cgroup_root: Path = CGROUP_ROOT, proc_self_cgroup: Path = Path("/proc/self/cgroup"),
    meminfo: Path = Path("/proc/meminfo"),
) -> HostMemory:  # fmt: skip
    """min(MemAvailable, the tightest cgroup's room); `cgroup_root`: where the cgroup hierarchy is mounted."""
    mem_available = mem_available_bytes(meminfo)
    reason = f"MemAvailable {mem_available / 2**30:.2f} GiB"
    room = cgroup_room(cgroup_root, proc_self_cgroup)
    if room is None:
        return HostMemory(mem_available, reason + " (no cgroup memory limit)")
    cgroup_reason = (
        f"cgroup {room.path} limit {room.limit_bytes / 2**30:.2f} GiB, {room.room_bytes / 2**30:.2f} GiB left"
    )
    if room.room_bytes < mem_available:
        return HostMemory(room.room_bytes, f"{cgroup_reason} (below {reason})")
    return HostMemory(mem_available, f"{reason} (below {cgroup_reason})")


def mem_available_bytes(meminfo: Path = Path("/proc/meminfo")) -> int:
    for line in meminfo.read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no MemAvailable in {meminfo}")


def cgroup_room(cgroup_root: Path, proc_self_cgroup: Path) -> _CgroupRoom | None:
    """The least room under any memory limit on this process's cgroup path (v2, else v1); None: no limit."""
    rooms = []
    for line in proc_self_cgroup.read_text().splitlines():
        hierarchy_id, controllers, path = line.split(":", 2)
        if hierarchy_id == "0" and controllers == "" and (cgroup_root / "cgroup.controllers").exists():
            rooms += _rooms_on_path(cgroup_root, path, "memory.max", "memory.current", "inactive_file")
        elif "memory" in controllers.split(","):
            v1_root = cgroup_root / "memory"
            rooms += _rooms_on_path(
                v1_root, path, "memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file"
            )
    return min(rooms, key=lambda room: room.room_bytes, default=None)


def _rooms_on_path(
    mount: Path, cgroup_path: str, limit_file: str, usage_file: str, inactive_key: str
) -> list[_CgroupRoom]:
    """Each limited cgroup from this process's own up to the mount's root. Inside a container the path
    /proc/self/cgroup names may be the host's, absent from the container's mount: those levels are skipped."""
    rooms = []
    directory = mount / cgroup_path.strip("/")
    for level in (directory, *directory.parents):
        if not level.is_relative_to(mount):
            break
        limit_path = level / limit_file
        if not limit_path.is_file():
            continue
        limit_text = limit_path.read_text().strip()
        if limit_text == "max" or int(limit_text) >= UNLIMITED_BYTES:
            continue
        usage_bytes = int((level / usage_file).read_text())
        room_bytes = max(
            0, int(limit_text) - (usage_bytes - _stat_value(level / "memory.stat", inactive_key))
        )
        rooms.append(_CgroupRoom(room_bytes=room_bytes, limit_bytes=int(limit_text), path=level))
    return rooms


def _stat_value(memory_stat: Path, key: str) -> int:
    if not memory_stat.is_file():
        return 0
    for line in memory_stat.read_text().splitlines():
        name, _, value = line.partition(" ")
        if name == key:
            return int(value)
    return 0
