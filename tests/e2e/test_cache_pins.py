"""End to end: session pins (`prompt_cache_key`) keep an agent session's KV through other traffic.

A session's first turn pins its prompt and output; competing requests with other prompts churn every unpinned
block of a small KV pool; the session's next turn (its previous prompt, output and more) still hits every
block of the previous turn's prompt, while the same conversation without the key misses — through raw
`/v1/completions`, through the official `openai` SDK's chat client (`prompt_cache_key`) and Responses client
(a stored response pins its conversation), and through the `anthropic` SDK (`cache_control`). Under memory
pressure the pins are released instead of preempting anything, and an expired pin leaves the pool whole. A
tiny random Llama with the default model's tokenizer keeps it cheap on the CPU.
"""

from __future__ import annotations

import random
import re
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import anthropic
import openai
import pytest
import requests

from .conftest import Server, start_server, stop_server

BLOCK_SIZE = 16
# 32 blocks of 16 tokens; pins may keep a quarter of them (the default --max-pinned-kv-fraction).
POOL = ("--max-batch-total-tokens", "512", "--max-batch-tokens", "256", "--max-input-tokens", "200",
        "--max-total-tokens", "400")  # fmt: skip


def completion(server: Server, prompt: str | list[int], max_tokens: int, **extra: object) -> dict:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, **extra}
    response = requests.post(f"{server.url}/v1/completions", json=body, timeout=600)
    assert response.status_code == 200, response.text
    return response.json()


def cached_tokens(body: dict) -> int:
    return body["usage"]["prompt_tokens_details"]["cached_tokens"]


def metric(server: Server, name: str) -> float:
    text = requests.get(f"{server.url}/metrics", timeout=10).text
    match = re.search(rf"^{re.escape(name)} (\S+)$", text, re.MULTILINE)
    assert match, f"{name} not in /metrics"
    return float(match.group(1))


def preemptions(server: Server) -> float:
    return sum(metric(server, f'rill_preemptions_total{{mode="{mode}"}}') for mode in ("recompute", "swap"))


def pins(server: Server) -> dict:
    return server.wait_idle()["kv"]["pins"]


def check_pool_whole(server: Server) -> None:
    kv = server.wait_idle()["kv"]
    assert kv["used_blocks"] == 0 and kv["free_blocks"] + kv["cached_blocks"] == kv["total_blocks"], kv


def churn(server: Server, num_pinned_blocks: int) -> None:
    """Competing traffic: 16 prompts of their own, about 6 blocks each, the whole pool three times over;
    checks that at least as many blocks were evicted as are not pinned."""
    evicted = metric(server, "rill_prefix_cache_evicted_blocks_total")
    for i in range(16):
        completion(server, f"Tenant {i} asks: " + " ".join(f"item{i * 100 + k}" for k in range(24)), 24)
    num_unpinned_blocks = server.info()["kv"]["total_blocks"] - num_pinned_blocks
    assert metric(server, "rill_prefix_cache_evicted_blocks_total") - evicted >= num_unpinned_blocks


@pytest.fixture(scope="module")
def pinned(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    server = start_server(tiny_model, tmp_path_factory.mktemp("pins"), *POOL)
    yield server
    stop_server(server)
    assert server.process.returncode == 0, server.log_path.read_text()[-3000:]


def test_a_pinned_session_survives_churn_and_its_next_turn_hits(pinned: Server) -> None:
    assert pinned.info()["kv"]["block_size"] == BLOCK_SIZE
    session = (
        "You are a coding agent with shell access to a repository; run one command per turn and explain it. "
        "List the files of the project, then read the README and summarise it."
    )
    control = (
        "You review pull requests for a small team; read each diff and point out one risk per turn. "
        "Open the latest pull request and read its description first."
    )
    first = completion(pinned, session, 24, prompt_cache_key="agent-1")
    control_first = completion(pinned, control, 24)
    num_prompt_tokens = first["usage"]["prompt_tokens"]
    # The pin holds the full blocks of what the turn computed: its prompt and output but the last token.
    num_pinned_blocks = (num_prompt_tokens + first["usage"]["completion_tokens"] - 1) // BLOCK_SIZE
    created = metric(pinned, "rill_kv_pins_created_total")
    assert pins(pinned) == {
        "pins": 1, "pinned_blocks": num_pinned_blocks, "max_pinned_blocks": 8, "default_ttl_s": 300,
        "max_ttl_s": 3600,
    }  # fmt: skip
    assert metric(pinned, "rill_kv_pinned_blocks") == num_pinned_blocks
    churn(pinned, num_pinned_blocks)
    # The next turns: the previous prompt, its output and a new request. Only the pinned session hits.
    follow_up = " Now open the first file."
    next_turn = session + first["choices"][0]["text"] + follow_up
    second = completion(pinned, next_turn, 8, prompt_cache_key="agent-1")
    # The prompt's last token may merge with the output's first when the text is tokenized again, so the
    # block holding it is not counted on.
    assert cached_tokens(second) >= (num_prompt_tokens - 1) // BLOCK_SIZE * BLOCK_SIZE > 0
    again = completion(pinned, control + control_first["choices"][0]["text"] + follow_up, 8)
    assert cached_tokens(again) == 0, "the unpinned session was churned away"
    assert pins(pinned)["pins"] == 1, "the next turn replaced the pin"
    assert metric(pinned, "rill_kv_pins_created_total") == created + 1
    check_pool_whole(pinned)


def test_an_openai_sdk_chat_session_keeps_its_cache_between_turns(pinned: Server) -> None:
    client = openai.OpenAI(base_url=f"{pinned.url}/v1", api_key="unused", max_retries=0)
    model = client.models.list().data[0].id

    def chat(messages: list[dict], key: str | None) -> openai.types.chat.ChatCompletion:
        extra = {"prompt_cache_key": key} if key else {}
        return client.chat.completions.create(
            model=model,
            messages=messages,
            max_tokens=16,
            temperature=0,
            extra_body={"ignore_eos": True},
            **extra,
        )

    # Two conversations with their own system prompts, so they share no block; only the first has a key.
    session = [
        {
            "role": "system",
            "content": "You are a build agent. Run one shell command per turn and report its output.",
        },
        {"role": "user", "content": "Compile the project in release mode and tell me whether it worked."},
    ]
    control = [
        {
            "role": "system",
            "content": "You are a docs agent. Read one page per turn and list its broken links.",
        },
        {"role": "user", "content": "Start with the page about deployment and then the one about flags."},
    ]
    replies = {}
    for name, messages, key in (("session", session, "agent-chat"), ("control", control, None)):
        first = chat(messages, key)
        replies[name] = (first.usage.prompt_tokens, first.choices[0].message.content)
    churn(pinned, pins(pinned)["pinned_blocks"])
    for name, messages, key in (("session", session, "agent-chat"), ("control", control, None)):
        num_prompt_tokens, reply = replies[name]
        messages += [
            {"role": "assistant", "content": reply},
            {"role": "user", "content": "Go on, next step."},
        ]
        details = chat(messages, key).usage.prompt_tokens_details
        assert details is not None
        if key:
            # The template renders turn 1's prompt again as the start of turn 2's.
            assert details.cached_tokens >= (num_prompt_tokens - 1) // BLOCK_SIZE * BLOCK_SIZE > 0
        else:
            assert details.cached_tokens == 0, "the unpinned conversation was churned away"
    check_pool_whole(pinned)


def test_a_stored_response_chain_keeps_its_cache_between_turns(pinned: Server) -> None:
    client = openai.OpenAI(base_url=f"{pinned.url}/v1", api_key="unused", max_retries=0)
    model = client.models.list().data[0].id

    def turn(text: str, store: bool, instructions: str, previous: str | None = None):
        # Instructions are not carried over by `previous_response_id`: an agent sends them every turn.
        return client.responses.create(
            model=model, input=text, instructions=instructions, previous_response_id=previous,
            store=store, max_output_tokens=16, temperature=0,
        )  # fmt: skip

    # A stored response pins its conversation under the chain's first id; `store: false` pins nothing.
    first = turn("Build the project and report the first error.", True, "You are a CI agent.")
    control = turn("Lint the project and report the first warning.", False, "You are a lint bot.")
    assert first.usage.input_tokens_details.cached_tokens == 0
    churn(pinned, pins(pinned)["pinned_blocks"])
    second = turn("Now fix it.", True, "You are a CI agent.", previous=first.id)
    # Turn 2's prompt is turn 1's tokens and more: every full block of turn 1 but the last token's.
    history = first.usage.input_tokens + first.usage.output_tokens
    assert second.usage.input_tokens_details.cached_tokens >= (history - 1) // BLOCK_SIZE * BLOCK_SIZE > 0
    third = turn("And run the tests.", True, "You are a CI agent.", previous=second.id)
    history = second.usage.input_tokens + second.usage.output_tokens
    assert third.usage.input_tokens_details.cached_tokens >= (history - 1) // BLOCK_SIZE * BLOCK_SIZE
    again = client.responses.create(
        model=model, instructions="You are a lint bot.", store=False, max_output_tokens=8, temperature=0,
        input=[
            {"role": "user", "content": "Lint the project and report the first warning."},
            {"role": "assistant", "content": control.output_text},
            {"role": "user", "content": "Now fix it."},
        ],
    )  # fmt: skip
    assert again.usage.input_tokens_details.cached_tokens == 0, "the unstored conversation was churned away"
    check_pool_whole(pinned)


def test_an_anthropic_cache_control_conversation_keeps_its_cache(pinned: Server) -> None:
    client = anthropic.Anthropic(base_url=pinned.url, api_key="unused", max_retries=0)
    model = openai.OpenAI(base_url=f"{pinned.url}/v1", api_key="unused").models.list().data[0].id

    def ask(system: str, messages: list[dict], cache: bool) -> anthropic.types.Message:
        block: dict = {"type": "text", "text": system}
        if cache:
            block["cache_control"] = {"type": "ephemeral"}
        return client.messages.create(
            model=model, max_tokens=16, system=[block], messages=messages, extra_body={"temperature": 0}
        )

    conversations = {
        True: ("You are a release agent.", "Tag the release and write its notes."),
        False: ("You are a triage bot.", "Label the newest issue and assign it."),
    }
    first = {cache: ask(system, [{"role": "user", "content": task}], cache)
             for cache, (system, task) in conversations.items()}  # fmt: skip
    churn(pinned, pins(pinned)["pinned_blocks"])
    for cache, (system, task) in conversations.items():
        reply = "".join(block.text for block in first[cache].content if block.type == "text")
        messages = [
            {"role": "user", "content": task},
            {"role": "assistant", "content": reply or "Done."},
            {"role": "user", "content": "Next step."},
        ]
        usage = ask(system, messages, cache).usage
        if cache:
            prompt = first[cache].usage.input_tokens + first[cache].usage.cache_read_input_tokens
            # The template renders turn 1's prompt again as the start of turn 2's.
            assert usage.cache_read_input_tokens >= (prompt - 1) // BLOCK_SIZE * BLOCK_SIZE > 0
        else:
            assert usage.cache_read_input_tokens == 0, (
                "the conversation without cache_control was churned away"
            )
    check_pool_whole(pinned)


def test_under_pressure_pins_go_before_anything_is_preempted(pinned: Server) -> None:
    completion(pinned, "Agent session three: run the test suite and report what fails, one line each.", 24,
               prompt_cache_key="agent-3")  # fmt: skip
    before = pins(pinned)
    assert before["pinned_blocks"] >= 2
    released = metric(pinned, 'rill_kv_pins_released_total{reason="pressure"}')
    preempted = preemptions(pinned)
    # Three sequences that together fill every block but one: more than the unpinned blocks, so the pins
    # must give way, and no sequence needs to be preempted.
    total_blocks = pinned.info()["kv"]["total_blocks"]
    num_blocks = (total_blocks - 1) // 3
    assert 3 * num_blocks > total_blocks - before["pinned_blocks"]
    rng = random.Random(35)
    prompts = [[rng.randrange(1000, 40000) for _ in range(96)] for _ in range(3)]
    max_tokens = num_blocks * BLOCK_SIZE - 96
    with ThreadPoolExecutor(3) as pool:
        bodies = list(pool.map(lambda prompt: completion(pinned, prompt, max_tokens), prompts))
    assert [body["usage"]["completion_tokens"] for body in bodies] == [max_tokens] * 3
    assert metric(pinned, 'rill_kv_pins_released_total{reason="pressure"}') > released
    assert preemptions(pinned) == preempted
    assert pins(pinned)["pinned_blocks"] < before["pinned_blocks"]
    check_pool_whole(pinned)


def test_expired_pins_leave_the_pool_whole(tiny_model: Path, tmp_path: Path) -> None:
    server = start_server(tiny_model, tmp_path, *POOL, "--cache-pin-ttl", "1")
    try:
        completion(server, "Agent session four: write a haiku about caches.", 40, prompt_cache_key="agent-4")
        assert metric(server, "rill_kv_pins_created_total") == 1
        deadline = time.monotonic() + 30
        # Nothing else arrives: the engine releases the pin at its deadline by itself.
        while pins(server)["pins"] > 0:
            assert time.monotonic() < deadline, "the pin never expired"
            time.sleep(0.2)
        assert pins(server)["pinned_blocks"] == 0
        assert metric(server, 'rill_kv_pins_released_total{reason="expired"}') == 1
        assert metric(server, "rill_kv_pinned_blocks") == 0
        check_pool_whole(server)
    finally:
        stop_server(server)
    assert server.process.returncode == 0, server.log_path.read_text()[-3000:]
