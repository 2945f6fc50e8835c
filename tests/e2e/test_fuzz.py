"""End to end: fuzzing the router's HTTP API with generated requests.

(a) schemathesis reads the running router's /openapi.json and sends generated requests to every operation
    (over 1,000 in all): no answer may be a 5xx — but the documented 504 of a request whose own `timeout`
    (as short as 1 ms) passed — and every answer must match the schema the document gives for its status.
(b) hypothesis sends random bodies to the generation and tokenize routes: random JSON, known fields with
    values of the wrong type, huge numbers, NaN and Infinity (as strings and as bare JSON literals), nested
    junk, invalid UTF-8, and strings up to the body limit. Never a 5xx, never a hang, always a JSON error
    body for a 4xx (in the OpenAI shape on /v1/*), and the server stays healthy and leaks no KV block.

The server is a tiny random Llama with small limits (--max-total-tokens 128), so any valid request is fast.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests

from .conftest import Server, make_tiny_model, start_server, stop_server
from .test_robustness import assert_kv_whole, outcomes

schemathesis = pytest.importorskip("schemathesis")
hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, example, given, settings  # noqa: E402 - after the importorskip
from hypothesis import strategies as st  # noqa: E402

MAX_BODY_BYTES = 2 * 1024 * 1024  # the router's default request body limit
SERVER_ARGS = (
    "--max-input-tokens", "64", "--max-total-tokens", "128", "--max-batch-tokens", "128",
    "--max-batch-total-tokens", "4096", "--max-batch-size", "16", "--max-concurrent-requests", "32",
    "--served-model-name", "tiny",
)  # fmt: skip
NUM_SCHEMATHESIS_EXAMPLES = 30
"""Per operation; hypothesis stops early for operations with few distinct inputs (GET /health ...)."""
MIN_SCHEMATHESIS_CASES = 1000
POST_ROUTES = (
    "/generate", "/generate_stream", "/v1/completions", "/v1/chat/completions", "/v1/messages",
    "/v1/messages/count_tokens", "/tokenize",
)  # fmt: skip


@pytest.fixture(scope="module")
def fuzz_server(default_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    model = make_tiny_model(default_model, tmp_path_factory.mktemp("tiny-fuzz"))
    server = start_server(model, tmp_path_factory.mktemp("fuzz"), *SERVER_ARGS)
    yield server
    stop_server(server)
    assert server.process.returncode == 0, server.log_path.read_text()[-3000:]


# --- (a) schemathesis against /openapi.json ------------------------------------------------------------


def test_schemathesis_never_5xx_and_responses_match_the_schema(fuzz_server: Server, tmp_path: Path) -> None:
    """The schemathesis CLI (its pytest plugin does not load under pytest 9) over every operation."""
    # A generated `timeout` of a millisecond rightly ends in a 504 (the deadline's documented answer).
    config = tmp_path / "schemathesis.toml"
    config.write_text('[checks.not_a_server_error]\nexpected-statuses = ["2xx", "3xx", "4xx", "504"]\n')
    command = [
        sys.executable, "-m", "schemathesis.cli", "--config-file", str(config),
        "run", f"{fuzz_server.url}/openapi.json",
        "--checks", "not_a_server_error,response_schema_conformance",
        "--max-examples", str(NUM_SCHEMATHESIS_EXAMPLES), "--seed", "1", "--workers", "1",
        "--continue-on-failure", "--request-timeout", "60", "--no-color",
    ]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, timeout=1500, cwd=tmp_path)
    output = result.stdout + result.stderr
    found = re.search(r"(\d+) generated", output)
    num_cases = int(found.group(1)) if found else 0
    print(f"schemathesis: {num_cases} cases, exit code {result.returncode}")
    assert result.returncode == 0, output[-12000:]
    assert num_cases >= MIN_SCHEMATHESIS_CASES, output[-3000:]
    selected, tested = re.search(r"Selected: \d+/(\d+)", output), re.search(r"Tested: (\d+)", output)
    assert selected and tested and tested.group(1) == selected.group(1), output[-3000:]  # every operation
    assert_kv_whole(fuzz_server)


# --- (b) hypothesis: random bodies to the generation and tokenize routes --------------------------------

FIELDS = (
    "inputs", "parameters", "stream", "max_new_tokens", "temperature", "top_k", "top_p", "seed", "stop",
    "details", "model", "prompt", "messages", "role", "content", "max_tokens", "n", "logprobs",
    "top_logprobs", "logit_bias", "stream_options", "include_usage", "echo", "add_special_tokens",
    "best_of", "repetition_penalty", "frequency_penalty", "presence_penalty", "min_p", "typical_p",
    "response_format", "tools", "ignore_eos", "min_tokens", "priority", "truncate", "cache_salt",
)  # fmt: skip
huge_ints = st.sampled_from([-(2**63), -1, 0, 2**31, 2**32, 2**53 + 1, 2**64, 10**30, -(10**30)])
nan_strings = st.sampled_from(["NaN", "nan", "Infinity", "-Infinity", "inf", "1e999", "-0", "", "\x00"])
scalars = st.one_of(
    st.none(), st.booleans(), st.integers(), huge_ints, nan_strings,
    st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=40),
)  # fmt: skip
junk = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.dictionaries(st.sampled_from(FIELDS) | st.text(max_size=8), inner, max_size=4),
    ),
    max_leaves=12,
)


def _valid_ish(route: str) -> st.SearchStrategy[dict]:
    """Bodies shaped like the route's own, with any field replaced by junk."""
    if route.startswith(("/v1/chat", "/v1/messages")):
        base = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    elif route.startswith("/v1/"):
        base = {"model": "tiny", "prompt": "hi", "max_tokens": 4}
    elif route == "/tokenize":
        base = {"inputs": "hi"}
    else:
        base = {"inputs": "hi", "parameters": {"max_new_tokens": 4}}
    keys = st.sampled_from(list(base) + list(FIELDS))
    overrides = st.dictionaries(keys, junk, max_size=4)
    params = st.dictionaries(st.sampled_from(FIELDS), junk, max_size=4)
    return st.builds(
        lambda over, inner: {
            **base,
            **over,
            **({"parameters": inner} if "parameters" in base and inner else {}),
        },
        overrides,
        params,
    )


def _encode(value: object) -> bytes:
    return json.dumps(value, allow_nan=True).encode()  # NaN/Infinity become bare, invalid JSON literals


def _corrupt(data: bytes, position: int, garbage: bytes) -> bytes:
    """Splices bytes that are not UTF-8 (or are truncated) into an otherwise valid body."""
    position %= len(data) + 1
    return data[:position] + garbage + data[position:]


bodies = st.one_of(
    junk.map(_encode),
    st.floats().map(lambda f: _encode({"inputs": "hi", "parameters": {"temperature": f}})),
    st.binary(max_size=64),
    st.builds(
        _corrupt,
        junk.map(_encode),
        st.integers(min_value=0),
        st.sampled_from([b"\xff", b"\xc3", b"\xed\xa0\x80", b"\x80\x80", b"\xf4\x90\x80\x80", b'"\\ud800"']),
    ),
    st.integers(min_value=1, max_value=20_000).map(lambda n: _encode({"inputs": "word " * n})),
)


def _route_body(route: str) -> st.SearchStrategy[bytes]:
    return st.one_of(bodies, _valid_ish(route).map(_encode))


def _check(route: str, status: int, headers: dict, payload_bytes: bytes) -> None:
    assert status < 500, (route, status, payload_bytes[:500])
    if status == 200:
        return
    assert "json" in headers.get("content-type", ""), (route, status, headers, payload_bytes[:300])
    payload = json.loads(payload_bytes)
    if route.startswith("/v1/"):
        assert isinstance(payload["error"], dict) and isinstance(payload["error"]["message"], str), payload
    else:
        assert isinstance(payload["error"], str) and isinstance(payload["error_type"], str), payload


@pytest.mark.parametrize("route", POST_ROUTES)
@settings(max_examples=80, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(data=st.data())
@example(data=None)  # the edge cases below, always
def test_random_bodies_never_5xx_and_errors_are_json(fuzz_server: Server, route: str, data) -> None:
    if data is None:
        payloads = [
            b"", b"null", b"{}", b"[]", b'{"inputs": NaN}', b'{"inputs": "hi", "parameters": {"seed": -1}}',
            _encode({"inputs": "x" * (MAX_BODY_BYTES - 20)})[:MAX_BODY_BYTES],  # up to the limit
            _encode({"inputs": "y" * (MAX_BODY_BYTES + 10)}),  # over it
            b'{"inputs": "hi", "parameters": {"max_new_tokens": 4}}' + b" " * 1000,
            b'{"a":' * 5000 + b"1" + b"}" * 5000,  # deep nesting
        ]  # fmt: skip
    else:
        payloads = [data.draw(_route_body(route))]
    for payload in payloads:
        for content_type in ("application/json",) if data is not None else ("application/json", "text/plain"):
            response = requests.post(
                fuzz_server.url + route, data=payload, headers={"Content-Type": content_type}, timeout=60
            )
            _check(route, response.status_code, dict(response.headers), response.content)


def test_server_healthy_after_fuzzing(fuzz_server: Server) -> None:
    assert requests.get(fuzz_server.url + "/health", timeout=10).status_code == 200
    ready = requests.get(fuzz_server.url + "/ready", timeout=10)
    assert ready.status_code == 200, ready.text
    assert_kv_whole(fuzz_server)
    counts = outcomes(fuzz_server.url)
    print(f"outcomes after fuzzing: {dict(counts)}")
    assert counts["failed"] == 0, counts
    response = requests.post(fuzz_server.url + "/generate", timeout=60,
                             json={"inputs": "The river", "parameters": {"max_new_tokens": 8}})  # fmt: skip
    assert response.status_code == 200 and response.json()["generated_text"], response.text
