"""End to end: a launcher killed outright (SIGKILL, as the OOM killer does) under load leaves no shard or
router behind — each child gets the parent-death signal and is gone within seconds, with its KV pool."""

from __future__ import annotations

import os
import re
import signal
import threading
import time
from pathlib import Path

import pytest
import requests

from .conftest import start_server

ARGS = ("--num-shard", "2", "--max-batch-tokens", "128", "--max-batch-total-tokens", "4096")
GONE_WITHIN_S = 5.0


def is_alive(pid: int) -> bool:
    """True while `pid` runs; a zombie waiting for a reaper (in a container's pid 1) counts as gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rpartition(")")[2].split()[0] != "Z"


def test_sigkill_of_the_launcher_under_load_leaves_no_process(
    tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    server = start_server(tiny_model, tmp_path_factory.mktemp("orphans"), *ARGS)
    log = server.log_path.read_text()
    pids = {name: int(pid) for name, pid in re.findall(r"(shard-\d|router) has pid (\d+)", log)}
    try:
        assert set(pids) == {"shard-0", "shard-1", "router"}, log

        def stream() -> None:
            body = {"inputs": "The river said", "parameters": {"max_new_tokens": 500}}
            try:
                with requests.post(f"{server.url}/generate_stream", json=body, stream=True, timeout=30) as r:
                    for _ in r.iter_lines():
                        pass
            except requests.RequestException:
                pass  # the server goes away mid-stream: expected

        clients = [threading.Thread(target=stream, daemon=True) for _ in range(4)]
        for client in clients:
            client.start()
        deadline = time.monotonic() + 30
        while server.info()["kv"]["running_requests"] < 4:
            assert time.monotonic() < deadline, "the streams never started"
            time.sleep(0.1)

        server.process.send_signal(signal.SIGKILL)
        server.process.wait(10)
        killed_at = time.monotonic()
        while alive := [name for name, pid in pids.items() if is_alive(pid)]:
            assert time.monotonic() - killed_at < GONE_WITHIN_S, f"still running: {alive}"
            time.sleep(0.1)
        for client in clients:
            client.join(30)
            assert not client.is_alive(), "a client still waits on a dead server"
    finally:
        server.process.kill()
        for pid in pids.values():
            if is_alive(pid):
                os.kill(pid, signal.SIGKILL)
