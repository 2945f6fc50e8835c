"""End to end: the prefix cache changes nothing but speed. Greedy outputs with the cache on (the shared
`server`) equal those of a server with `--no-prefix-caching`, for shared prefixes, multi-turn chats,
prompts ending exactly on a block boundary and prompts entirely cached; salts isolate tenants."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import requests

from .conftest import Server, start_server, stop_server

SYSTEM = (
    "You are a helpful assistant for a company that sells garden tools. Answer briefly and politely. "
    "The catalogue has rakes, spades, hoes, shears, watering cans, wheelbarrows and gloves. "
) * 4


@pytest.fixture(scope="module")
def uncached(default_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    srv = start_server(
        default_model, tmp_path_factory.mktemp("uncached"),
        "--max-batch-tokens", "256",
        "--max-batch-total-tokens", "20000",
        "--no-prefix-caching",
    )  # fmt: skip
    yield srv
    stop_server(srv)


def completion(server: Server, prompt: str | list[int], max_tokens: int = 8, **extra: object) -> dict:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **extra}
    response = requests.post(f"{server.url}/v1/completions", json=body, timeout=600)
    assert response.status_code == 200, response.text
    return response.json()


def metric(server: Server, name: str) -> float:
    for line in requests.get(f"{server.url}/metrics", timeout=10).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not exported")


def test_shared_prefix_outputs_equal_cache_off(server: Server, uncached: Server) -> None:
    hits_before = metric(server, "rill_prefix_cache_hit_tokens_total")
    questions = ["Do you sell rakes?", "What are shears for?", "Is a hoe sharp?", "Can I buy gloves?"]
    for question in questions:
        prompt = SYSTEM + "Question: " + question + " Answer:"
        cached = completion(server, prompt)
        fresh = completion(uncached, prompt)
        assert cached["choices"][0]["text"] == fresh["choices"][0]["text"], question
    assert metric(server, "rill_prefix_cache_hit_tokens_total") > hits_before, "the shared prefix never hit"
    last = completion(server, SYSTEM + "Question: Do you sell rakes? Answer:")
    assert last["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


def test_multi_turn_chat_hits_the_previous_turn(server: Server, uncached: Server) -> None:
    messages = [{"role": "user", "content": "Name three garden tools."}]
    for turn in range(3):
        bodies = {"messages": messages, "max_tokens": 12, "temperature": 0}
        cached = requests.post(f"{server.url}/v1/chat/completions", json=bodies, timeout=600).json()
        fresh = requests.post(f"{uncached.url}/v1/chat/completions", json=bodies, timeout=600).json()
        reply = cached["choices"][0]["message"]["content"]
        assert reply == fresh["choices"][0]["message"]["content"], f"turn {turn}"
        if turn > 0:
            cached_tokens = cached["usage"]["prompt_tokens_details"]["cached_tokens"]
            assert cached_tokens > 0, f"turn {turn} missed the cache"
        messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": "And one more?"}]


@pytest.mark.parametrize("num_tokens", [16, 32, 48, 50])
def test_block_boundaries_and_fully_cached_prompts(server: Server, uncached: Server, num_tokens: int) -> None:
    block_size = server.info()["kv"]["block_size"]
    assert block_size == 16
    prompt = [(7919 * i + num_tokens) % 40000 + 100 for i in range(num_tokens)]
    first = completion(server, prompt)
    again = completion(server, prompt)  # every full block of the prompt is cached now
    fresh = completion(uncached, prompt)
    assert first["choices"][0]["text"] == again["choices"][0]["text"] == fresh["choices"][0]["text"]
    cached_tokens = again["usage"]["prompt_tokens_details"]["cached_tokens"]
    # The last prompt token is always recomputed for its logits, so a prompt ending on a block boundary
    # reuses every block but the last.
    assert cached_tokens == ((num_tokens - 1) // block_size) * block_size


def test_salts_never_share_blocks(server: Server) -> None:
    prompt = SYSTEM + "Question: which tool digs holes? Answer:"
    completion(server, prompt, cache_salt="tenant-a")
    other = completion(server, prompt, cache_salt="tenant-b")
    same = completion(server, prompt, cache_salt="tenant-a")
    assert other["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert same["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert other["choices"][0]["text"] == same["choices"][0]["text"]


def test_idle_pool_is_whole_with_the_cache(server: Server) -> None:
    info = server.wait_idle()
    kv = info["kv"]
    assert kv["used_blocks"] == 0
    assert kv["free_blocks"] + kv["cached_blocks"] == kv["total_blocks"]
    assert kv["prefix_cache_blocks"] >= kv["cached_blocks"] > 0
