"""End to end: Rill under abuse — clients that vanish, a shard that dies, SIGTERM under load, overload.

Every test runs a tiny random Llama (with the default model's tokenizer, so text round-trips) behind the
real launcher, router and shard, with small limits so the CPU cost stays small. Tests that kill or stop
their server start their own; the others share one per test.

What each proves:
- 200 streaming clients that disconnect at random points (before reading a byte, after the headers, mid
  stream) are each counted once as `cancelled`, and every KV block comes back;
- a shard killed with SIGKILL under load ends every request in flight with an error within seconds, and
  the launcher exits non-zero;
- SIGTERM under load lets the requests in flight finish with their whole output, answers later ones 503
  (or refuses the connection once the router is gone), and the launcher exits 0;
- 500 requests at once against --max-concurrent-requests 64 each get their output or a 429, and every
  KV block comes back.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import random
import re
import select
import signal
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import aiohttp
import requests

from .conftest import Server, start_server, stop_server

# Small limits: a short prompt, outputs long enough that no disconnecting client can see its stream end.
BASE_ARGS = (
    "--max-input-tokens", "64", "--max-total-tokens", "1024", "--max-batch-tokens", "256",
    "--max-batch-total-tokens", "8192", "--kv-block-size", "16",
)  # fmt: skip
PROMPT = "The river said"


def metric(server_url: str, name: str, **labels: str) -> float:
    """One sample of /metrics (0 when the series does not exist yet)."""
    text = requests.get(f"{server_url}/metrics", timeout=10).text
    wanted = name + ("{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}" if labels else "")
    for line in text.splitlines():
        key, _, value = line.rpartition(" ")
        if key == wanted:
            return float(value)
    return 0.0


def outcomes(server_url: str) -> Counter[str]:
    text = requests.get(f"{server_url}/metrics", timeout=10).text
    found = re.findall(r'^rill_requests_total\{outcome="(\w+)"\} (\S+)$', text, re.MULTILINE)
    return Counter({outcome: int(float(value)) for outcome, value in found})


def assert_kv_whole(server: Server) -> dict:
    """Waits until the server is idle; then no KV block may be held by a request."""
    kv = server.wait_idle(timeout_s=60)["kv"]
    assert kv["used_blocks"] == 0, kv
    assert kv["free_blocks"] + kv["cached_blocks"] == kv["total_blocks"], kv
    return kv


def shard_pid(server: Server, rank: int = 0) -> int:
    found = re.search(rf"shard-{rank} has pid (\d+)", server.log_path.read_text())
    assert found, server.log_path.read_text()[-2000:]
    return int(found.group(1))


def stream_body(max_new_tokens: int, prompt: str = PROMPT) -> bytes:
    return json.dumps({"inputs": prompt, "parameters": {"max_new_tokens": max_new_tokens}}).encode()


def open_stream(url: str, body: bytes, path: str = "/generate_stream") -> http.client.HTTPConnection:
    parts = urlsplit(url)
    connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=60)
    connection.request("POST", path, body=body, headers={"Content-Type": "application/json"})
    return connection


@dataclass
class StreamEnd:
    """How a stream ended, as its client saw it."""

    status: int | None = None
    num_tokens: int = 0
    is_complete: bool = False
    """The last event (with `generated_text` and `details`) arrived."""
    error: str | None = None
    """An `event: error`, a non-200 answer's body, or the exception that cut the stream."""
    text: str = ""
    generated_text: str | None = None
    ended_at: float = 0.0


def read_stream(response: http.client.HTTPResponse, max_events: int | None = None) -> StreamEnd:
    """Reads SSE events until the stream ends, an error event arrives, or `max_events` token events."""
    end = StreamEnd(status=response.status)
    if response.status != 200:
        end.error = response.read().decode("utf-8", "replace")
        end.ended_at = time.monotonic()
        return end
    event_name = "message"
    try:
        while max_events is None or end.num_tokens < max_events:
            line = response.readline()
            if not line:
                break
            line = line.rstrip(b"\r\n")
            if line.startswith(b"event:"):
                event_name = line[6:].strip().decode()
            elif line.startswith(b"data:"):
                payload = json.loads(line[5:])
                if event_name == "error" or "error" in payload:
                    end.error = str(payload)
                    break
                end.num_tokens += 1
                end.text += payload["token"]["text"]
                if payload.get("details") is not None:
                    end.is_complete = True
                    end.generated_text = payload["generated_text"]
                    break
            elif not line:
                event_name = "message"
    except (OSError, http.client.HTTPException, ValueError) as error:
        end.error = f"{type(error).__name__}: {error}"
    end.ended_at = time.monotonic()
    return end


def disconnecting_client(url: str, seed: int) -> bool:
    """Opens a long stream and drops it at a seeded random point; True if it saw the stream's end."""
    rng = random.Random(seed)
    mode = rng.choice(("before-first-byte", "after-delay", "after-headers", "mid-stream", "mid-stream"))
    connection = open_stream(url, stream_body(1000))
    try:
        if mode in ("before-first-byte", "after-delay"):
            # Hang up without reading a byte, once the answer has started to arrive. Not sooner: a request
            # whose client has already hung up when the server first reads the socket (request and end of
            # stream in one read) is dropped by hyper before any handler runs; it never becomes a request
            # anywhere, costs nothing, and no server can count it.
            select.select([connection.sock], [], [], 30)
            if mode == "after-delay":
                time.sleep(rng.uniform(0.0, 0.5))  # more answer bytes arrive, unread
            return False
        response = connection.getresponse()
        assert response.status == 200, response.read()
        if mode == "after-headers":
            return False
        return read_stream(response, max_events=rng.randint(1, 40)).is_complete
    finally:
        connection.sock and connection.sock.close()
        connection.close()


def test_200_disconnecting_streams_are_cancelled_and_free_their_blocks(
    tiny_model: Path, tmp_path: Path
) -> None:
    server = start_server(
        tiny_model, tmp_path, *BASE_ARGS, "--max-batch-size", "32",
        "--max-concurrent-requests", "256", "--max-waiting-requests", "256",
    )  # fmt: skip
    try:
        before = outcomes(server.url)
        start = time.monotonic()
        with ThreadPoolExecutor(200) as pool:
            finished = sum(pool.map(lambda seed: disconnecting_client(server.url, seed), range(200)))
        # A client that hung up at once can leave its request still being read and tokenized, not yet
        # waiting (so the server looks idle): wait until all 200 have an outcome, or 30 s have passed.
        deadline = time.monotonic() + 30
        while sum((outcomes(server.url) - before).values()) < 200 and time.monotonic() < deadline:
            time.sleep(0.1)
        kv = assert_kv_whole(server)
        after = outcomes(server.url)
        elapsed_s = time.monotonic() - start
        delta = after - before
        print(
            f"200 disconnecting clients: {finished} finished, outcomes {dict(delta)}, {elapsed_s:.1f} s; {kv}"
        )
        assert finished == 0  # 1000 tokens: no client reads that far before it drops
        assert delta["cancelled"] == 200 - finished, delta
        assert delta["success"] == finished and delta["failed"] == 0, delta
        assert metric(server.url, "rill_cancelled_tokens_total") > 0
        # The server carries on as if nothing happened.
        response = requests.post(server.url + "/generate", data=stream_body(8), timeout=60,
                                 headers={"Content-Type": "application/json"})  # fmt: skip
        assert response.status_code == 200, response.text
        assert requests.get(server.url + "/ready", timeout=10).status_code == 200
    finally:
        stop_server(server)
    assert server.process.returncode == 0, server.log_path.read_text()[-3000:]


def test_shard_killed_under_load_fails_every_request_fast(tiny_model: Path, tmp_path: Path) -> None:
    # 8 streams run (--max-batch-size 8) and 12 non-streaming requests wait in the queue behind them.
    server = start_server(tiny_model, tmp_path, *BASE_ARGS, "--max-batch-size", "8")
    try:
        pid = shard_pid(server)
        started = threading.Barrier(8 + 1)

        def stream() -> StreamEnd:
            connection = open_stream(server.url, stream_body(1000))
            response = connection.getresponse()
            first = read_stream(response, max_events=1)
            started.wait(timeout=60)
            rest = read_stream(response)
            rest.num_tokens += first.num_tokens
            connection.close()
            return rest

        def generate() -> StreamEnd:
            try:
                response = requests.post(server.url + "/generate", data=stream_body(1000), timeout=60,
                                         headers={"Content-Type": "application/json"})  # fmt: skip
                return StreamEnd(status=response.status_code, error=response.text, ended_at=time.monotonic())
            except requests.RequestException as error:
                return StreamEnd(error=f"{type(error).__name__}: {error}", ended_at=time.monotonic())

        with ThreadPoolExecutor(20) as pool:
            streams = [pool.submit(stream) for _ in range(8)]
            started.wait(timeout=60)  # every stream has its first token
            others = [pool.submit(generate) for _ in range(12)]
            time.sleep(0.5)  # the non-streaming requests are running or waiting
            os.kill(pid, signal.SIGKILL)
            killed_at = time.monotonic()
            ends = [future.result(timeout=60) for future in streams + others]
        delays = [end.ended_at - killed_at for end in ends]
        kinds = Counter(
            "sse-error" if end.status == 200 and end.error and end.error.startswith("{")
            else "cut" if end.status == 200 or end.status is None
            else str(end.status)
            for end in ends
        )  # fmt: skip
        print(f"shard killed: every request ended within {max(delays):.2f}s (kinds {dict(kinds)})")
        assert not any(end.is_complete for end in ends)
        for end in ends[:8]:  # streams: an error event, never a silently cut stream
            assert end.status == 200 and end.error and end.error.startswith("{"), end
        for end in ends[8:]:  # non-streaming: a 5xx with a JSON body
            assert end.status is not None and end.status >= 500, end
            assert "error" in json.loads(end.error), end
        assert max(delays) < 3.0, delays
        server.process.wait(timeout=60)
    finally:
        stop_server(server)
    log = server.log_path.read_text()
    assert server.process.returncode not in (0, None), log[-3000:]
    assert "shard-0 exited with code -9 (killed by SIGKILL)" in log, log[-3000:]


IN_FLIGHT_TOKENS = 600


def test_sigterm_under_load_finishes_in_flight_and_refuses_new(tiny_model: Path, tmp_path: Path) -> None:
    server = start_server(
        tiny_model, tmp_path, *BASE_ARGS, "--max-batch-size", "16", "--shutdown-timeout", "60"
    )
    try:
        started = threading.Barrier(12 + 1)

        def stream() -> StreamEnd:
            # Long enough that the drain outlasts the first late requests however fast the runner is.
            connection = open_stream(server.url, stream_body(IN_FLIGHT_TOKENS))
            response = connection.getresponse()
            first = read_stream(response, max_events=1)
            started.wait(timeout=60)
            rest = read_stream(response)
            rest.num_tokens += first.num_tokens
            rest.text = first.text + rest.text
            connection.close()
            return rest

        with ThreadPoolExecutor(12) as pool:
            futures = [pool.submit(stream) for _ in range(12)]
            started.wait(timeout=60)
            server.process.send_signal(signal.SIGTERM)
            signalled_at = time.monotonic()
            # Requests sent once the launcher passed the signal on: 503, or refused once the router is gone.
            while "stopping router" not in server.log_path.read_text():
                assert time.monotonic() - signalled_at < 10, server.log_path.read_text()[-2000:]
                time.sleep(0.02)
            time.sleep(0.2)  # the router has the signal
            late: Counter[str] = Counter()
            while server.process.poll() is None and time.monotonic() - signalled_at < 90:
                try:
                    response = requests.post(server.url + "/generate", data=stream_body(4), timeout=10,
                                             headers={"Content-Type": "application/json"})  # fmt: skip
                    late[str(response.status_code)] += 1
                    if response.status_code == 503:
                        assert "error" in response.json(), response.text
                except requests.ConnectionError:
                    late["refused"] += 1
                time.sleep(0.05)
            ends = [future.result(timeout=90) for future in futures]
        server.process.wait(timeout=60)
        print(f"SIGTERM: {len(ends)} in flight finished; later requests: {dict(late)}")
        for end in ends:
            assert end.is_complete and end.error is None, end
            assert end.num_tokens == IN_FLIGHT_TOKENS or end.generated_text is not None, end
            assert end.generated_text == end.text, end
        assert set(late) <= {"503", "refused"}, late
        assert late["503"] > 0, late  # the drain took long enough to see the router refuse
    finally:
        stop_server(server)
    assert server.process.returncode == 0, server.log_path.read_text()[-3000:]


async def _burst(url: str, num_requests: int) -> Counter[str]:
    timeout = aiohttp.ClientTimeout(total=120)
    body = {"inputs": PROMPT, "parameters": {"max_new_tokens": 8}}
    async with aiohttp.ClientSession(
        timeout=timeout, connector=aiohttp.TCPConnector(limit=0)
    ) as http_session:

        async def one() -> str:
            try:
                async with http_session.post(url + "/generate", json=body) as response:
                    payload = await response.json(content_type=None)
                    if response.status == 200 and isinstance(payload.get("generated_text"), str):
                        return "ok"
                    if response.status == 429:
                        assert response.headers.get("Retry-After"), response.headers
                        assert payload["error_type"] and payload["error"], payload
                        return "429"
                    return f"{response.status}: {payload}"
            except (aiohttp.ClientError, asyncio.TimeoutError) as error:
                return f"{type(error).__name__}: {error}"

        return Counter(await asyncio.gather(*(one() for _ in range(num_requests))))


def test_500_requests_at_once_get_output_or_429(tiny_model: Path, tmp_path: Path) -> None:
    server = start_server(
        tiny_model, tmp_path, *BASE_ARGS, "--max-batch-size", "32",
        "--max-concurrent-requests", "64", "--max-waiting-requests", "64",
    )  # fmt: skip
    try:
        before = outcomes(server.url)
        start = time.monotonic()
        counts = asyncio.run(_burst(server.url, 500))
        elapsed_s = time.monotonic() - start
        kv = assert_kv_whole(server)
        delta = outcomes(server.url) - before
        print(f"500 at once: {dict(counts)} in {elapsed_s:.1f}s; server outcomes {dict(delta)}; kv {kv}")
        assert set(counts) <= {"ok", "429"}, counts
        assert counts["ok"] + counts["429"] == 500
        assert counts["ok"] >= 64 and counts["429"] > 0, counts
        assert delta["success"] == counts["ok"] and delta["overloaded"] == counts["429"], delta
    finally:
        stop_server(server)
    assert server.process.returncode == 0, server.log_path.read_text()[-3000:]
