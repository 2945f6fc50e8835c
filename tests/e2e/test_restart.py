"""End to end: with `--restart-shards`, a killed shard fails the requests in flight, `/ready` answers 503
naming the shards while `/health` stays 200, the shard is restarted, and the same router serves new requests
again (a shard killed while idle fails none: the idle router finds it restarted and warms it up); without it
the launcher exits non-zero (tests/test_launcher.py)."""

from __future__ import annotations

import os
import re
import signal
import threading
import time
from pathlib import Path

import pytest
import requests

from .conftest import start_server, stop_server


def test_a_killed_shard_is_restarted_and_serving_resumes(
    default_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    server = start_server(
        default_model, tmp_path_factory.mktemp("restart"),
        "--max-batch-tokens", "128", "--max-batch-total-tokens", "8192", "--restart-shards",
    )  # fmt: skip
    try:
        pids = [int(p) for p in re.findall(r"shard-0 has pid (\d+)", server.log_path.read_text())]
        assert pids, server.log_path.read_text()
        outcome: dict[str, object] = {}

        def in_flight() -> None:
            body = {"inputs": "Count: 1, 2, 3,", "parameters": {"max_new_tokens": 200}}
            started = time.monotonic()
            response = requests.post(f"{server.url}/generate", json=body, timeout=120)
            outcome["status"], outcome["seconds"] = response.status_code, time.monotonic() - started
            outcome["body"] = response.json()

        thread = threading.Thread(target=in_flight)
        thread.start()
        time.sleep(1.5)
        killed_at = time.monotonic()
        os.kill(pids[-1], signal.SIGKILL)
        thread.join(60)
        assert not thread.is_alive(), "the request in flight hangs"
        assert outcome["status"] == 500, outcome
        assert "shard" in str(outcome["body"]).lower()
        # While the shard is down the router is alive but not ready, and says why.
        ready = requests.get(f"{server.url}/ready", timeout=15)
        assert ready.status_code == 503, ready.text
        assert ready.json()["status"] == "not_ready" and "shard" in ready.json()["reason"], ready.text
        assert requests.get(f"{server.url}/health", timeout=5).status_code == 200
        # The launcher restarts the shard and the router warms it up again.
        deadline = time.monotonic() + 180
        while True:
            assert server.process.poll() is None, server.log_path.read_text()[-3000:]
            ready = requests.get(f"{server.url}/ready", timeout=5)
            if ready.status_code == 200:
                break
            assert time.monotonic() < deadline, ready.text
            time.sleep(1)
        assert time.monotonic() - killed_at < 180
        body = {"inputs": "The capital of France is", "parameters": {"max_new_tokens": 5}}
        again = requests.post(f"{server.url}/generate", json=body, timeout=120)
        assert again.status_code == 200, again.text
        assert len(re.findall(r"shard-0 has pid (\d+)", server.log_path.read_text())) == 2
        assert server.info()["kv"]["used_blocks"] == 0 or server.wait_idle()["kv"]["used_blocks"] == 0
    finally:
        stop_server(server)
    assert server.process.returncode == 0


def test_a_shard_killed_while_idle_is_warmed_up_before_the_next_request(
    default_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """Nothing runs when the shard dies, so no request fails to reveal it: the idle router's health checks
    find the restarted shard unwarmed, `/ready` stays 503 until it is warmed up, and then the same prompt
    gets the same answer (the new pool and the prefix cache start empty)."""
    server = start_server(default_model, tmp_path_factory.mktemp("idle-restart"), "--restart-shards")
    body = {"inputs": "The capital of France is", "parameters": {"max_new_tokens": 8}}
    try:
        before = requests.post(f"{server.url}/generate", json=body, timeout=120)
        assert before.status_code == 200, before.text
        server.wait_idle()
        pid = int(re.findall(r"shard-0 has pid (\d+)", server.log_path.read_text())[-1])
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 180
        while "the shards are back; serving again" not in server.log_path.read_text():
            assert server.process.poll() is None, server.log_path.read_text()[-3000:]
            assert time.monotonic() < deadline, server.log_path.read_text()[-3000:]
            time.sleep(0.5)
        assert "the shards restarted; warming them up again" in server.log_path.read_text()
        assert requests.get(f"{server.url}/ready", timeout=5).status_code == 200
        after = requests.post(f"{server.url}/generate", json=body, timeout=120)
        assert after.status_code == 200, after.text
        assert after.json()["generated_text"] == before.json()["generated_text"]
    finally:
        stop_server(server)
    assert server.process.returncode == 0
