"""End to end: with --json-logs every router log line is one JSON object, and a request's lines carry the
x-request-id the client sent (the `http request` access line and the engine's `request finished` line);
the response echoes that id. The launcher's and the shards' own lines stay text (Python's logging format).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import requests

from .conftest import start_server, stop_server

REQUEST_ID = "json-logs-e2e-51c2"
# launcher.LOG_FORMAT and the shard's format: "2026-01-01 12:00:00,123 INFO name: message".
PYTHON_LOG_LINE = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} (DEBUG|INFO|WARNING|ERROR|CRITICAL) ")
PROGRESS_BAR = re.compile(r"\d+%\|")  # the shard's weight-loading bar (tqdm)


def test_json_logs_carry_the_request_id(tiny_model: Path, tmp_path: Path) -> None:
    server = start_server(tiny_model, tmp_path, "--json-logs")
    try:
        response = requests.post(
            f"{server.url}/generate",
            json={"inputs": "The river said", "parameters": {"max_new_tokens": 3}},
            headers={"x-request-id": REQUEST_ID},
            timeout=120,
        )
        assert response.status_code == 200, response.text
        assert response.headers["x-request-id"] == REQUEST_ID
        # A request without an id gets a fresh one, echoed too.
        assert requests.get(f"{server.url}/health", timeout=10).headers["x-request-id"]
    finally:
        stop_server(server)
    assert server.process.returncode == 0, server.log_path.read_text()[-3000:]

    router_lines = []
    for line in server.log_path.read_text().splitlines():
        if not line.strip() or PYTHON_LOG_LINE.match(line) or PROGRESS_BAR.search(line):
            continue  # the launcher's and the shards' text lines, a progress bar
        try:
            router_lines.append(json.loads(line))
        except json.JSONDecodeError:
            pytest.fail(f"a router log line is not JSON: {line!r}")
    assert router_lines, "no router log line"
    assert all({"timestamp", "level", "message", "target"} <= set(entry) for entry in router_lines)
    assert any(entry["message"] == "stopped" for entry in router_lines), "the last line is JSON too"

    ours = [entry for entry in router_lines if entry.get("request_id") == REQUEST_ID]
    [access] = [entry for entry in ours if entry["message"] == "http request"]
    assert access["path"] == "/generate" and access["method"] == "POST" and access["status"] == 200
    assert access["latency_ms"] > 0
    [finished] = [entry for entry in ours if entry["message"] == "request finished"]
    assert finished["outcome"] == "success"
    assert finished["generated_tokens"] == 3 and finished["prompt_tokens"] >= 2
    assert 0 <= finished["queue_ms"] <= finished["ttft_ms"] <= finished["e2e_ms"]
