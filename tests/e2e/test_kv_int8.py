"""End to end with `--kv-cache-dtype int8`: the default model answers, its greedy tokens stay close to the
float32 pool's, the shard says which KV dtype it sized, and swap preemption (which copies the scales too)
changes no token.

Greedy agreement with the float32 pool (the session server): the share of generated tokens before each
answer's first difference, over PROMPTS (measured figure in docs/kernels.md, "int8 KV cache").
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import requests

from .conftest import SERVER_FLAGS, Server, start_server, stop_server
from .test_preemption import ROOMY_POOL, SWAPPED_IN, TINY_POOL, metric, serve

PROMPTS = [
    "The capital of France is",
    "Write a short poem about the sea.",
    "Explain in one paragraph why the sky is blue.",
    "List three uses of a paperclip:",
]
MAX_NEW_TOKENS = 48
# Of the generated tokens, before each answer's first difference (measured: 80 of 80; one early difference
# would cost the rest of its answer, hence the margin).
AGREEMENT_FLOOR = 0.75


@pytest.fixture(scope="module")
def int8_server(default_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    srv = start_server(
        default_model, tmp_path_factory.mktemp("int8"), *SERVER_FLAGS, "--kv-cache-dtype", "int8"
    )
    yield srv
    stop_server(srv)
    assert srv.process.returncode == 0, srv.log_path.read_text()[-3000:]


def greedy(server: Server, prompt: str) -> list[int]:
    response = requests.post(
        f"{server.url}/generate",
        json={"inputs": prompt, "parameters": {"max_new_tokens": MAX_NEW_TOKENS, "details": True}},
        timeout=600,
    )
    assert response.status_code == 200, response.text
    return [token["id"] for token in response.json()["details"]["tokens"]]


def common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def test_the_default_model_answers_close_to_the_float_pool(server: Server, int8_server: Server) -> None:
    float_tokens = [greedy(server, prompt) for prompt in PROMPTS]
    int8_tokens = [greedy(int8_server, prompt) for prompt in PROMPTS]
    assert all(int8_tokens)
    agreed = sum(common_prefix(a, b) for a, b in zip(float_tokens, int8_tokens, strict=True))
    total = sum(len(tokens) for tokens in float_tokens)
    print(f"greedy tokens before the first difference, int8 vs float32 KV: {agreed}/{total}")
    assert agreed >= AGREEMENT_FLOOR * total
    log = int8_server.log_path.read_text()
    assert "KV dtype int8 with float32 scales" in log
    kv = int8_server.wait_idle()["kv"]
    assert kv["used_blocks"] == 0 and kv["free_blocks"] + kv["cached_blocks"] == kv["total_blocks"], kv


def test_int8_pool_with_swap_preemption_gives_the_roomy_outputs(tiny_model: Path, tmp_path: Path) -> None:
    """tests/e2e/test_preemption.py's swap case (32 requests on a pool for about 7) over int8 pools: the
    outputs are bitwise those of a roomy int8 pool, so the swapped blocks came back with their scales."""
    int8 = ("--kv-cache-dtype", "int8")
    (tmp_path / "roomy").mkdir()
    (tmp_path / "tiny").mkdir()
    expected, _ = serve(tiny_model, tmp_path / "roomy", *int8, *ROOMY_POOL)
    outputs, metrics = serve(tiny_model, tmp_path / "tiny", *int8, *TINY_POOL, "--preemption-mode", "swap")
    assert metric(metrics, 'rill_preemptions_total{mode="swap"}') > 0
    assert metric(metrics, SWAPPED_IN) > 0
    assert outputs == expected
