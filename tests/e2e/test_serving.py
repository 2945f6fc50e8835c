"""End to end: launcher + Rust router + Python shard + the default model, checked against oracles.

Oracles: `transformers`' greedy generate on the same weights; the same request sent alone vs in a batch;
streaming vs non-streaming text. Everything runs on the CPU in float32.
"""

from __future__ import annotations

import json
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import requests
import torch

from .conftest import Server

PROMPT = "The three primary colors are"


def generate(server: Server, inputs: str, **parameters: object) -> dict:
    response = requests.post(
        f"{server.url}/generate",
        json={"inputs": inputs, "parameters": {"details": True, **parameters}},
        timeout=600,
    )
    assert response.status_code == 200, response.text
    return response.json()


def stream(server: Server, inputs: str, **parameters: object) -> list[dict]:
    response = requests.post(
        f"{server.url}/generate_stream",
        json={"inputs": inputs, "parameters": parameters},
        stream=True,
        timeout=600,
    )
    assert response.status_code == 200, response.text
    events = []
    for line in response.iter_lines(decode_unicode=False):
        if line.startswith(b"data:"):
            events.append(json.loads(line[len(b"data:") :].decode("utf-8")))
    return events


def token_ids(result: dict) -> list[int]:
    return [token["id"] for token in result["details"]["tokens"]]


@pytest.fixture(scope="module")
def hf_model(default_model: Path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(default_model, dtype=torch.float32)
    model.eval()
    return model, AutoTokenizer.from_pretrained(default_model)


def hf_greedy(hf_model, prompt: str, max_new_tokens: int) -> list[int]:
    model, tokenizer = hf_model
    input_ids = tokenizer(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        output = model.generate(
            input_ids,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            attention_mask=torch.ones_like(input_ids),
        )
    return output[0, input_ids.shape[1] :].tolist()


def test_greedy_matches_transformers(server: Server, hf_model) -> None:
    result = generate(server, PROMPT, max_new_tokens=32)
    expected = hf_greedy(hf_model, PROMPT, 32)
    assert token_ids(result) == expected
    assert result["details"]["generated_tokens"] == len(expected)


def test_chunked_prefill_matches_transformers(server: Server, hf_model) -> None:
    # The server runs with --max-batch-tokens 256: this ~700-token prompt is prefilled in three chunks.
    _, tokenizer = hf_model
    colors = ["red", "green", "blue"]
    prompt = " ".join(f"Item {i} is a {random.Random(i).choice(colors)} box." for i in range(90))
    prompt += " The last item is a"
    assert len(tokenizer(prompt).input_ids) > 600
    result = generate(server, prompt, max_new_tokens=12)
    assert token_ids(result) == hf_greedy(hf_model, prompt, 12)


def prompts_of_many_lengths(tokenizer, count: int, max_tokens: int) -> list[str]:
    rng = random.Random(0)
    words = "river stone light garden music window paper silver cloud engine forest letter".split()
    text = " ".join(rng.choice(words) for _ in range(max_tokens * 2))
    ids = tokenizer(text).input_ids
    lengths = [1 + (max_tokens - 1) * i // (count - 1) for i in range(count)]
    return [tokenizer.decode(ids[:n]) for n in lengths]


def test_batching_changes_nothing(server: Server, hf_model) -> None:
    _, tokenizer = hf_model
    prompts = prompts_of_many_lengths(tokenizer, 24, 1000)
    max_new = [1 + (7 * i) % 16 for i in range(len(prompts))]
    alone = [token_ids(generate(server, p, max_new_tokens=n)) for p, n in zip(prompts, max_new, strict=True)]
    server.wait_idle()
    with ThreadPoolExecutor(len(prompts)) as pool:
        together = list(
            pool.map(
                lambda pn: token_ids(generate(server, pn[0], max_new_tokens=pn[1])),
                zip(prompts, max_new, strict=True),
            )
        )
    for i, (a, b) in enumerate(zip(alone, together, strict=True)):
        assert a == b, f"prompt {i} ({len(tokenizer(prompts[i]).input_ids)} tokens): alone {a} != batched {b}"
    info = server.wait_idle()
    assert info["kv"]["used_blocks"] == 0


@pytest.mark.parametrize(
    "prompt",
    [
        "Hãy viết một câu về thành phố Hà Nội bằng tiếng Việt:",
        "请用中文写一句关于北京的话：北京是",
        "Reply with emojis only: 🎉🚀🌈🔥",
    ],
)
def test_stream_concatenates_to_the_full_text(server: Server, prompt: str) -> None:
    events = stream(server, prompt, max_new_tokens=24)
    assert events, "no events streamed"
    pieces = [event["token"]["text"] for event in events]
    assert all("\ufffd" not in piece for piece in pieces), pieces
    last = events[-1]
    assert last["generated_text"] == "".join(pieces)
    assert last["details"]["generated_tokens"] == len(events)
    assert all(event["generated_text"] is None for event in events[:-1])
    full = generate(server, prompt, max_new_tokens=24)
    assert full["generated_text"] == last["generated_text"]
    assert [event["token"]["id"] for event in events] == token_ids(full)


def test_short_request_overtakes_a_long_one(server: Server) -> None:
    counting = ", ".join(str(i) for i in range(1, 40)) + ","
    long_result: dict[str, object] = {}

    def run_long() -> None:
        long_result["events"] = stream(server, counting, max_new_tokens=150)
        long_result["finished"] = time.monotonic()

    long_thread = threading.Thread(target=run_long)
    long_thread.start()
    time.sleep(1.0)  # the long generation is decoding by now
    short = generate(server, "Hello", max_new_tokens=4)
    short_finished = time.monotonic()
    long_thread.join()
    events = long_result["events"]
    assert isinstance(events, list)
    assert events[-1]["details"]["finish_reason"] == "length", "the long request ended early"
    assert short["details"]["generated_tokens"] == 4
    assert short_finished < long_result["finished"]


def test_stop_sequence_and_eos_end_generation(server: Server) -> None:
    full = generate(server, PROMPT, max_new_tokens=32)["generated_text"]
    words = full.split()
    assert len(words) > 3, full
    stop = words[2]
    result = generate(server, PROMPT, max_new_tokens=32, stop=[stop])
    assert result["details"]["finish_reason"] == "stop_sequence"
    assert result["generated_text"] == full[: full.index(stop)]
    assert stop not in result["generated_text"]


def test_sampling_with_a_seed_is_reproducible(server: Server) -> None:
    params = {
        "max_new_tokens": 16,
        "do_sample": True,
        "temperature": 0.9,
        "top_p": 0.95,
        "top_k": 50,
        "seed": 1234,
    }
    first = generate(server, PROMPT, **params)
    with ThreadPoolExecutor(4) as pool:
        others = list(pool.map(lambda _: generate(server, "Tell me a joke.", max_new_tokens=8), range(3)))
        again = generate(server, PROMPT, **params)
    assert others
    assert token_ids(first) == token_ids(again)
    assert first["details"]["seed"] == 1234


def test_bad_requests_get_clear_errors(server: Server) -> None:
    cases = [
        ({"inputs": "", "parameters": {}}, "inputs"),
        ({"inputs": "hi", "parameters": {"temperature": -1}}, "temperature"),
        ({"inputs": "hi", "parameters": {"max_new_tokens": 100000}}, "max-total-tokens"),
        ({"inputs": "hi", "parameters": {"top_p": 2}}, "top_p"),
        ({"inputs": "hi", "parameters": {"bogus": 1}}, "bogus"),
        ({"parameters": {}}, "inputs"),
    ]
    for body, field in cases:
        response = requests.post(f"{server.url}/generate", json=body, timeout=30)
        assert response.status_code == 422, (body, response.text)
        error = response.json()
        assert field in error["error"], (body, error)
        assert error["error_type"] == "validation"
    response = requests.post(
        f"{server.url}/generate", data=b"{not json", timeout=30, headers={"content-type": "application/json"}
    )
    assert response.status_code == 400
    assert "error" in response.json()
    assert generate(server, PROMPT, max_new_tokens=2)["details"]["generated_tokens"] == 2


def test_every_block_returns_to_the_pool(server: Server) -> None:
    kv = server.wait_idle()["kv"]
    assert kv["total_blocks"] > 0
    assert kv["used_blocks"] == 0
    # Blocks no sequence holds are free or kept by the prefix cache for later hits.
    assert kv["free_blocks"] + kv["cached_blocks"] == kv["total_blocks"]
