"""End to end: --request-timeout and the per-request `timeout` field. A request that runs past its deadline
ends on time with the documented error — 504 with a JSON body (native and OpenAI APIs), or an SSE `error`
event on a stream — is counted as `timeout`, and its KV blocks are freed; a request's own `timeout` may
shorten the server's deadline, never lengthen it, and a bad one is a 422 naming the field; a request that
finishes in time is unaffected."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests

from .conftest import Server, start_server, stop_server
from .test_robustness import outcomes

REQUEST_TIMEOUT_S = 0.5
LONG = {"inputs": "The river said", "parameters": {"max_new_tokens": 500}}  # the tiny model: 512 positions


@pytest.fixture(scope="module")
def server(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    srv = start_server(
        tiny_model, tmp_path_factory.mktemp("deadlines"),
        "--request-timeout", str(REQUEST_TIMEOUT_S), "--max-input-tokens", "64", "--max-total-tokens", "512",
        "--max-batch-total-tokens", "16384",
    )  # fmt: skip
    yield srv
    stop_server(srv)
    assert srv.process.returncode == 0, srv.log_path.read_text()[-3000:]


def assert_504_on_time(server: Server, body: dict, deadline_s: float) -> None:
    """`body` on /generate ends with a 504 naming `deadline_s`, that long after it was sent, blocks freed."""
    started = time.monotonic()
    response = requests.post(f"{server.url}/generate", json=body, timeout=60)
    elapsed = time.monotonic() - started
    assert response.status_code == 504, response.text
    assert f"{deadline_s} s deadline" in response.json()["error"]
    assert deadline_s <= elapsed < deadline_s + 2, elapsed
    assert server.wait_idle()["kv"]["used_blocks"] == 0


def test_a_long_request_gets_504_on_time(server: Server) -> None:
    before = outcomes(server.url)
    assert_504_on_time(server, LONG, REQUEST_TIMEOUT_S)
    delta = outcomes(server.url) - before
    assert delta == {"timeout": 1}, delta


def test_a_long_stream_ends_with_an_error_event_on_time(server: Server) -> None:
    started = time.monotonic()
    events = []
    with requests.post(f"{server.url}/generate_stream", json=LONG, stream=True, timeout=60) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith(b"data:"):
                events.append(json.loads(line[5:]))
    elapsed = time.monotonic() - started
    assert len(events) > 1 and "token" in events[0], events[:2]
    assert "deadline" in events[-1]["error"], events[-1]
    assert REQUEST_TIMEOUT_S <= elapsed < REQUEST_TIMEOUT_S + 2, elapsed
    assert server.wait_idle()["kv"]["used_blocks"] == 0


def test_openai_completions_get_504_with_an_openai_error(server: Server) -> None:
    body = {"model": server.info()["served_model_name"], "prompt": "The river said", "max_tokens": 500}
    response = requests.post(f"{server.url}/v1/completions", json=body, timeout=60)
    assert response.status_code == 504, response.text
    assert "deadline" in response.json()["error"]["message"]
    assert server.wait_idle()["kv"]["used_blocks"] == 0


def test_a_short_request_is_unaffected(server: Server) -> None:
    body = {"inputs": "The river said", "parameters": {"max_new_tokens": 4}}
    response = requests.post(f"{server.url}/generate", json=body, timeout=60)
    assert response.status_code == 200, response.text


OWN_TIMEOUT_S = 0.2


def test_a_request_timeout_shortens_the_server_deadline(server: Server) -> None:
    body = {"inputs": LONG["inputs"], "parameters": {**LONG["parameters"], "timeout": OWN_TIMEOUT_S}}
    assert_504_on_time(server, body, OWN_TIMEOUT_S)


def test_a_request_timeout_never_lengthens_the_server_deadline(server: Server) -> None:
    body = {"inputs": LONG["inputs"], "parameters": {**LONG["parameters"], "timeout": 30}}
    response = requests.post(f"{server.url}/generate", json=body, timeout=60)
    assert response.status_code == 504, response.text
    assert f"{REQUEST_TIMEOUT_S} s deadline" in response.json()["error"]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_openai_timeout_ends_a_stream_with_an_error_event(server: Server, path: str) -> None:
    model = server.info()["served_model_name"]
    body = {"model": model, "max_tokens": 400, "stream": True, "timeout": OWN_TIMEOUT_S}
    if path == "/v1/completions":
        body["prompt"] = "The river said"
    else:
        body["messages"] = [{"role": "user", "content": "The river said"}]
    events = []
    with requests.post(f"{server.url}{path}", json=body, stream=True, timeout=60) as response:
        assert response.status_code == 200, response.text
        for line in response.iter_lines():
            if line.startswith(b"data:") and line != b"data: [DONE]":
                events.append(json.loads(line[5:]))
    assert f"{OWN_TIMEOUT_S} s deadline" in events[-1]["error"]["message"], events[-1]
    assert server.wait_idle()["kv"]["used_blocks"] == 0


@pytest.mark.parametrize("timeout", [0, -1, 1e7, "soon"])
def test_a_bad_timeout_is_a_422_naming_the_field(server: Server, timeout: object) -> None:
    native = {"inputs": "The river said", "parameters": {"timeout": timeout}}
    response = requests.post(f"{server.url}/generate", json=native, timeout=60)
    assert response.status_code == 422 and "timeout" in response.json()["error"], response.text
    if isinstance(timeout, str):
        return  # serde names no field of OpenAI's flattened bodies in a type error (as for every field)
    openai = {"model": server.info()["served_model_name"], "prompt": "The river said", "timeout": timeout}
    response = requests.post(f"{server.url}/v1/completions", json=openai, timeout=60)
    assert response.status_code == 422 and "timeout" in response.json()["error"]["message"], response.text
