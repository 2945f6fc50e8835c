"""End to end: a client that stops reading its stream is cut off (--max-unread-tokens) without slowing the
others.

16 clients stream 300 tokens each, reading every event, twice: alone, then beside a client that opened a
1,000-token stream and never reads a byte (its socket's receive buffer made small, as a stalled phone's
would be full). The stalled client's stream stops being pulled once the socket buffers are full
(TCP_NOTSENT_LOWAT on the router's side), its unread events pile up in its bounded channel, and past
--max-unread-tokens the engine cancels it: `rill_slow_readers_total` and `cancelled` move, the log names its
request id and the reason, and once idle no KV block is in use. The readers' inter-token latency p99 must
stay within 20% of the run without it (plus 10 ms of slack, as both runs share 2 CPU cores with the test's
own 16 reading threads, where a few milliseconds of scheduling noise are the rule).
"""

from __future__ import annotations

import http.client
import json
import socket
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from .conftest import Server, start_server, stop_server
from .test_robustness import BASE_ARGS, PROMPT, assert_kv_whole, metric, outcomes

MAX_UNREAD_TOKENS = 32
NUM_READERS = 16
READER_TOKENS = 300
SLOW_READER_TOKENS = 1000
SLOW_READER_ID = "slow-reader-1"
ITL_P99_RATIO = 1.2
ITL_SLACK_S = 0.010


@pytest.fixture(scope="module")
def server(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    srv = start_server(
        tiny_model, tmp_path_factory.mktemp("slow-readers"), *BASE_ARGS,
        "--max-unread-tokens", str(MAX_UNREAD_TOKENS), "--max-batch-size", "32",
    )  # fmt: skip
    yield srv
    stop_server(srv)


def body(max_new_tokens: int) -> bytes:
    return json.dumps({"inputs": PROMPT, "parameters": {"max_new_tokens": max_new_tokens}}).encode()


def read_gaps(url: str) -> list[float]:
    """Streams READER_TOKENS tokens, reading every event; returns the gaps between token arrivals."""
    parts = urlsplit(url)
    connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=120)
    headers = {"Content-Type": "application/json"}
    connection.request("POST", "/generate_stream", body=body(READER_TOKENS), headers=headers)
    response = connection.getresponse()
    assert response.status == 200, response.read()
    arrivals = []
    while line := response.readline():
        if line.startswith(b"data:"):
            payload = json.loads(line[5:])
            assert "error" not in payload, payload
            arrivals.append(time.monotonic())
            if payload.get("details") is not None:
                break
    connection.close()
    assert len(arrivals) == READER_TOKENS, len(arrivals)
    return [b - a for a, b in zip(arrivals, arrivals[1:], strict=False)]


def readers_itl_p99(url: str) -> float:
    with ThreadPoolExecutor(NUM_READERS) as pool:
        gaps = sorted(gap for gaps in pool.map(read_gaps, [url] * NUM_READERS) for gap in gaps)
    return gaps[int(0.99 * (len(gaps) - 1))]


def open_stalled_stream(url: str) -> socket.socket:
    """Sends a long streaming request from a socket with a small receive buffer, and never reads."""
    parts = urlsplit(url)
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect((parts.hostname, parts.port))
    payload = body(SLOW_READER_TOKENS)
    head = (
        f"POST /generate_stream HTTP/1.1\r\nHost: {parts.netloc}\r\nContent-Type: application/json\r\n"
        f"x-request-id: {SLOW_READER_ID}\r\nContent-Length: {len(payload)}\r\n\r\n"
    )
    sock.sendall(head.encode() + payload)
    return sock


def test_a_stalled_reader_is_cut_off_without_slowing_the_others(server: Server) -> None:
    readers_itl_p99(server.url)  # warm up: first-request costs stay out of the baseline
    baseline_p99 = readers_itl_p99(server.url)
    before = outcomes(server.url)
    stalled = open_stalled_stream(server.url)
    try:
        deadline = time.monotonic() + 30
        while server.info()["kv"]["running_requests"] == 0:  # it is being served
            assert time.monotonic() < deadline, "the stalled stream never started"
            time.sleep(0.05)
        with_stalled_p99 = readers_itl_p99(server.url)
        deadline = time.monotonic() + 60
        while metric(server.url, "rill_slow_readers_total") < 1:
            assert time.monotonic() < deadline, "the stalled reader was never cut off"
            time.sleep(0.1)
        assert_kv_whole(server)
    finally:
        stalled.close()
    print(f"readers' ITL p99: {baseline_p99 * 1e3:.1f} ms alone, {with_stalled_p99 * 1e3:.1f} ms beside it")
    assert with_stalled_p99 <= ITL_P99_RATIO * baseline_p99 + ITL_SLACK_S, (baseline_p99, with_stalled_p99)
    delta = outcomes(server.url) - before
    assert delta["cancelled"] == 1 and delta["success"] == NUM_READERS, delta
    assert metric(server.url, "rill_slow_readers_total") == 1
    log = [line for line in server.log_path.read_text().splitlines() if SLOW_READER_ID in line]
    assert any("slow_reader" in line and "cancelled" in line for line in log), log[-5:]
