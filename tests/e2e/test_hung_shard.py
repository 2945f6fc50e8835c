"""End to end: a shard that hangs without exiting (SIGSTOP) under load. Every streaming request in flight ends
with an error within the forward deadline, `/ready` answers 503 with the reason, the launcher kills the hung
shard (it misses its health checks) and, with --restart-shards, service comes back with the KV pool whole."""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time
from pathlib import Path

import pytest
import requests

from .conftest import start_server, stop_server

FORWARD_TIMEOUT_S = 5
NUM_STREAMS = 4


def stream_until_end(url: str, outcome: dict[str, object]) -> None:
    """Reads one stream to its end; records its last SSE event and when the stream ended."""
    body = {"inputs": "The river said", "parameters": {"max_new_tokens": 3000}}
    last_event = None
    try:
        with requests.post(f"{url}/generate_stream", json=body, stream=True, timeout=120) as response:
            for line in response.iter_lines():
                if line.startswith(b"data:"):
                    last_event = json.loads(line[5:])
                elif line.startswith(b"event:"):
                    outcome.setdefault("event_names", []).append(line.decode())
    except requests.RequestException as error:
        outcome["exception"] = repr(error)
    outcome["last_event"] = last_event
    outcome["ended_at"] = time.monotonic()


def test_a_stopped_shard_fails_requests_in_flight_and_is_replaced(
    tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    server = start_server(
        tiny_model, tmp_path_factory.mktemp("hung"),
        "--max-total-tokens", "4096", "--max-batch-tokens", "128", "--max-batch-total-tokens", "65536",
        "--forward-timeout", str(FORWARD_TIMEOUT_S), "--restart-shards",
    )  # fmt: skip
    shard_pid = int(re.findall(r"shard-0 has pid (\d+)", server.log_path.read_text())[-1])
    try:
        outcomes: list[dict[str, object]] = [{} for _ in range(NUM_STREAMS)]
        streams = [
            threading.Thread(target=stream_until_end, args=(server.url, outcome), daemon=True)
            for outcome in outcomes
        ]
        for thread in streams:
            thread.start()
        deadline = time.monotonic() + 30
        while server.info()["kv"]["running_requests"] < NUM_STREAMS:
            assert time.monotonic() < deadline, "the streams never started"
            time.sleep(0.1)

        os.kill(shard_pid, signal.SIGSTOP)
        stopped_at = time.monotonic()
        for thread in streams:
            thread.join(FORWARD_TIMEOUT_S + 15)
            assert not thread.is_alive(), "a stream in flight still hangs"
        for outcome in outcomes:
            assert outcome["ended_at"] - stopped_at < FORWARD_TIMEOUT_S + 10, outcome  # type: ignore[operator]
            last_event = outcome["last_event"]
            assert isinstance(last_event, dict) and "error" in last_event, outcome
            assert "deadline" in last_event["error"], outcome
        ready = requests.get(f"{server.url}/ready", timeout=15)
        assert ready.status_code == 503 and ready.json()["reason"], ready.text

        # The launcher finds the shard hung, kills it and starts another; the router warms it up.
        deadline = time.monotonic() + 180
        while requests.get(f"{server.url}/ready", timeout=15).status_code != 200:
            assert server.process.poll() is None, server.log_path.read_text()[-3000:]
            assert time.monotonic() < deadline, server.log_path.read_text()[-3000:]
            time.sleep(1)
        log = server.log_path.read_text()
        assert "shard-0 missed 5 health checks in a row: hung; killing it" in log
        assert len(re.findall(r"shard-0 has pid (\d+)", log)) == 2
        body = {"inputs": "The capital of France is", "parameters": {"max_new_tokens": 5}}
        again = requests.post(f"{server.url}/generate", json=body, timeout=60)
        assert again.status_code == 200, again.text
        assert server.wait_idle()["kv"]["used_blocks"] == 0
    finally:
        try:
            os.kill(shard_pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        stop_server(server)
    assert server.process.returncode == 0, server.log_path.read_text()[-3000:]
