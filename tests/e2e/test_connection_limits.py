"""End to end: connection floods and slow headers. 2,000 idle connections and a client sending its headers a
byte a second do not slow ordinary requests; the router closes every one of them once the header read
timeout has passed; connections beyond --max-connections are closed on accept, and service carries on."""

from __future__ import annotations

import resource
import socket
import statistics
import threading
import time
from pathlib import Path

import pytest
import requests

from .conftest import Server, start_server, stop_server

HEADER_READ_TIMEOUT_S = 15
MAX_CONNECTIONS = 2100
NUM_IDLE = 2000
BODY = {"inputs": "The river said", "parameters": {"max_new_tokens": 4}}


def latencies(server: Server, num_requests: int = 6) -> list[float]:
    seconds = []
    for _ in range(num_requests):
        started = time.monotonic()
        response = requests.post(f"{server.url}/generate", json=BODY, timeout=30)
        assert response.status_code == 200, response.text
        seconds.append(time.monotonic() - started)
    return seconds


def is_closed(sock: socket.socket) -> bool:
    """True when the server has closed the connection (EOF, a reset, or a last error answer)."""
    sock.setblocking(False)
    try:
        return sock.recv(4096) is not None
    except BlockingIOError:
        return False
    except ConnectionError:
        return True


def connect(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=10)


def test_idle_connections_and_slow_headers_do_not_slow_others(
    tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = NUM_IDLE + 1000
    if hard != resource.RLIM_INFINITY and hard < wanted:
        pytest.skip(f"needs {wanted} file descriptors, the hard limit is {hard}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, wanted), hard))
    server = start_server(
        tiny_model, tmp_path_factory.mktemp("connections"),
        "--header-read-timeout", str(HEADER_READ_TIMEOUT_S), "--max-connections", str(MAX_CONNECTIONS),
        "--max-batch-total-tokens", "4096",
    )  # fmt: skip
    port = int(server.url.rsplit(":", 1)[1])
    idle: list[socket.socket] = []
    try:
        baseline = statistics.median(latencies(server))

        flood_started = time.monotonic()
        idle = [connect(port) for _ in range(NUM_IDLE)]
        slow = connect(port)
        connected_at = time.monotonic()  # the server's timers started between flood_started and now
        slow_closed_after: list[float] = []

        def send_headers_slowly() -> None:
            started = time.monotonic()
            for byte in b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n":
                try:
                    slow.send(bytes([byte]))
                except OSError:
                    slow_closed_after.append(time.monotonic() - started)
                    return
                time.sleep(1.0)

        slow_thread = threading.Thread(target=send_headers_slowly, daemon=True)
        slow_thread.start()
        during = statistics.median(latencies(server))
        assert time.monotonic() - flood_started < HEADER_READ_TIMEOUT_S, "the check ran past the timeout"
        assert during <= 2 * baseline + 0.25, f"median {during:.3f}s under the flood, {baseline:.3f}s before"

        # Beyond the cap: closed as soon as accepted.
        extra = [connect(port) for _ in range(200)]
        time.sleep(1.0)
        num_refused = sum(is_closed(sock) for sock in extra)
        assert num_refused >= 200 - (MAX_CONNECTIONS - NUM_IDLE - 1), num_refused
        for sock in extra:
            sock.close()

        # Past the header read timeout every idle connection and the slow one are closed.
        time.sleep(max(0.0, connected_at + HEADER_READ_TIMEOUT_S + 3 - time.monotonic()))
        num_open = sum(not is_closed(sock) for sock in idle)
        assert num_open == 0, f"{num_open} idle connections still open"
        slow_thread.join(5)
        assert not slow_thread.is_alive() and slow_closed_after, "the slow-header client was not cut off"
        assert slow_closed_after[0] < HEADER_READ_TIMEOUT_S + 3
        # Ordinary service afterwards.
        assert statistics.median(latencies(server)) <= 2 * baseline + 0.25
    finally:
        for sock in idle:
            sock.close()
        stop_server(server)
    assert server.process.returncode == 0, server.log_path.read_text()[-3000:]
