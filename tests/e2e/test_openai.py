"""End to end: the OpenAI-compatible API with the official `openai` client, chat templates, logprobs,
stop strings across token boundaries in every path, seeds in a crowd, and `n > 1` sharing a prefill."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest
import requests
import torch

from .conftest import Server
from .test_serving import generate, hf_model, stream  # noqa: F401 - hf_model is a fixture

PROMPT = "The three primary colors are"
CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You answer in one short sentence."},
        {"role": "user", "content": "Name a fruit."},
        {"role": "assistant", "content": "An apple."},
        {"role": "user", "content": "Name another one."},
    ],
]


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def model_name(server: Server) -> str:
    return server.info()["served_model_name"]


def test_models_lists_the_served_model(client: openai.OpenAI, default_model: Path) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == [default_model.name]


def test_completions_with_the_openai_client(client: openai.OpenAI, model_name: str) -> None:
    completion = client.completions.create(model=model_name, prompt=PROMPT, max_tokens=12, temperature=0)
    assert completion.object == "text_completion"
    choice = completion.choices[0]
    assert choice.finish_reason in ("stop", "length")
    assert completion.usage is not None
    assert completion.usage.completion_tokens <= 12
    usage = completion.usage
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    pieces = []
    final_usage = None
    for chunk in client.completions.create(
        model=model_name,
        prompt=PROMPT,
        max_tokens=12,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    ):
        if chunk.choices:
            pieces.append(chunk.choices[0].text)
        if chunk.usage is not None:
            final_usage = chunk.usage
    assert "".join(pieces) == choice.text
    assert final_usage is not None and final_usage.completion_tokens == completion.usage.completion_tokens


def test_chat_with_the_openai_client(client: openai.OpenAI, model_name: str) -> None:
    chat = client.chat.completions.create(
        model=model_name,
        messages=CONVERSATIONS[1],
        max_tokens=16,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
        n=2,
        seed=7,
    )
    assert chat.object == "chat.completion"
    assert len(chat.choices) == 2
    assert chat.choices[0].message.role == "assistant"
    # Greedy: both choices agree whatever their seeds.
    assert chat.choices[0].message.content == chat.choices[1].message.content
    logprobs = chat.choices[0].logprobs
    assert logprobs is not None and logprobs.content
    for token in logprobs.content:
        assert len(token.top_logprobs) == 3
        assert token.top_logprobs[0].logprob >= token.top_logprobs[1].logprob
        assert token.logprob == pytest.approx(token.top_logprobs[0].logprob, abs=1e-5)  # greedy picks the top
    assert chat.usage.prompt_tokens > 0
    streamed = ""
    for chunk in client.chat.completions.create(
        model=model_name, messages=CONVERSATIONS[1], max_tokens=16, temperature=0, stream=True
    ):
        if chunk.choices and chunk.choices[0].delta.content:
            streamed += chunk.choices[0].delta.content
    assert streamed == chat.choices[0].message.content


def test_sampled_choices_differ_and_seeds_reproduce(client: openai.OpenAI, model_name: str) -> None:
    kwargs = dict(model=model_name, prompt="Once upon a time", max_tokens=16, temperature=1.0, n=2, seed=11)
    first = client.completions.create(**kwargs)
    again = client.completions.create(**kwargs)
    assert [c.text for c in first.choices] == [c.text for c in again.choices]
    assert first.choices[0].text != first.choices[1].text


def test_openai_errors(client: openai.OpenAI, server: Server) -> None:
    with pytest.raises(openai.NotFoundError) as missing:
        client.completions.create(model="no-such-model", prompt="x", max_tokens=1)
    assert missing.value.body["code"] == "model_not_found"
    with pytest.raises(openai.UnprocessableEntityError) as bad:
        client.completions.create(
            model=server.info()["served_model_name"], prompt="x", max_tokens=1, temperature=-1
        )
    assert bad.value.body["param"] == "temperature"
    response = requests.post(f"{server.url}/v1/completions", json={"prompt": "x", "best_of": 3}, timeout=30)
    assert response.status_code == 422
    assert "best_of" in response.json()["error"]["message"]


@pytest.mark.parametrize("conversation", CONVERSATIONS, ids=["single-turn", "multi-turn"])
def test_chat_template_matches_transformers(server: Server, hf_model, conversation) -> None:  # noqa: F811
    _, tokenizer = hf_model
    response = requests.post(f"{server.url}/tokenize", json={"messages": conversation}, timeout=30).json()
    expected = tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
    assert response["prompt"] == expected
    expected_ids = tokenizer(expected, add_special_tokens=False).input_ids
    assert [t["id"] for t in response["tokens"]] == expected_ids


def test_logprobs_match_the_model(server: Server, hf_model) -> None:  # noqa: F811
    model, tokenizer = hf_model
    result = generate(server, PROMPT, max_new_tokens=8, top_n_tokens=5)
    prompt_ids = tokenizer(PROMPT).input_ids
    generated = [t["id"] for t in result["details"]["tokens"]]
    with torch.no_grad():
        logits = model(torch.tensor([prompt_ids + generated])).logits[0].float()
    reference = torch.log_softmax(logits, dim=-1)[len(prompt_ids) - 1 : -1]
    for position, token in enumerate(result["details"]["tokens"]):
        assert token["logprob"] == pytest.approx(reference[position, token["id"]].item(), abs=1e-3)
        top = result["details"]["top_tokens"][position]
        expected_top = torch.topk(reference[position], 5)
        assert [t["id"] for t in top] == expected_top.indices.tolist()
        for got, want in zip(top, expected_top.values.tolist(), strict=True):
            assert got["logprob"] == pytest.approx(want, abs=1e-3)


def spanning_stop(server: Server) -> tuple[str, str]:
    """A stop string that starts inside one generated token and ends inside another."""
    result = generate(server, PROMPT, max_new_tokens=24)
    texts = [t["text"] for t in result["details"]["tokens"]]
    full = result["generated_text"]
    offset = 0
    for i, text in enumerate(texts[:-2]):
        nxt = texts[i + 1]
        if len(text) >= 2 and len(nxt) >= 2 and text.strip() and nxt.strip():
            start = offset + len(text) - 1
            stop = full[start : start + 2]
            if full.index(stop) == start:
                return full, stop
        offset += len(text)
    raise AssertionError(f"no token pair to build a spanning stop string from: {texts}")


def test_stop_strings_never_leak_in_any_path(server: Server, client: openai.OpenAI, model_name: str) -> None:
    full, stop = spanning_stop(server)
    expected = full[: full.index(stop)]
    # Native, not streamed.
    native = generate(server, PROMPT, max_new_tokens=24, stop=[stop])
    assert native["generated_text"] == expected
    assert native["details"]["finish_reason"] == "stop_sequence"
    # Native, streamed: every prefix of the stream is a prefix of the expected text.
    events = stream(server, PROMPT, max_new_tokens=24, stop=[stop])
    streamed = ""
    for event in events:
        streamed += event["token"]["text"]
        assert expected.startswith(streamed), (streamed, stop)
    assert streamed == expected
    # OpenAI, not streamed and streamed.
    completion = client.completions.create(
        model=model_name, prompt=PROMPT, max_tokens=24, temperature=0, stop=[stop]
    )
    assert completion.choices[0].text == expected
    assert completion.choices[0].finish_reason == "stop"
    streamed = ""
    for chunk in client.completions.create(
        model=model_name, prompt=PROMPT, max_tokens=24, temperature=0, stop=[stop], stream=True
    ):
        if chunk.choices:
            streamed += chunk.choices[0].text
            assert expected.startswith(streamed), (streamed, stop)
    assert streamed == expected


def test_a_seed_gives_the_same_text_among_16_others(server: Server) -> None:
    params = {"max_new_tokens": 12, "do_sample": True, "temperature": 0.8, "top_k": 40, "seed": 99}
    alone = generate(server, "My favourite animal is", **params)["generated_text"]
    others = [f"Question {i}: what is {i} plus {i}?" for i in range(16)]
    with ThreadPoolExecutor(17) as pool:
        crowd = [
            pool.submit(generate, server, p, max_new_tokens=12, do_sample=True, seed=i)
            for i, p in enumerate(others)
        ]
        together = pool.submit(generate, server, "My favourite animal is", **params)
        assert together.result()["generated_text"] == alone
        assert all(f.result()["details"]["generated_tokens"] > 0 for f in crowd)


def test_n_choices_cost_one_prompt_prefill(server: Server, hf_model) -> None:  # noqa: F811
    _, tokenizer = hf_model
    prompt = "Describe the ocean in detail. " * 20
    num_prompt_tokens = len(tokenizer(prompt).input_ids)
    block_size = server.info()["kv"]["block_size"]
    server.wait_idle()
    before = server.info()["kv"]["prompt_tokens_computed"]
    body = {"prompt": prompt, "max_tokens": 4, "n": 4, "temperature": 1.0, "seed": 3}
    response = requests.post(f"{server.url}/v1/completions", json=body, timeout=600)
    assert response.status_code == 200, response.text
    assert len(response.json()["choices"]) == 4
    computed = server.info()["kv"]["prompt_tokens_computed"] - before
    # One full prefill, plus at most one block's worth of tail tokens per extra choice.
    assert num_prompt_tokens <= computed <= num_prompt_tokens + 3 * block_size, (computed, num_prompt_tokens)
    assert json.loads(response.text)["usage"]["prompt_tokens"] == num_prompt_tokens


def test_render_gives_the_ids_the_real_requests_prefill(
    server: Server, client: openai.OpenAI, model_name: str
) -> None:
    def ids(body: dict) -> list[int]:
        answer = requests.post(f"{server.url}/tokenize", json=body, timeout=30)
        assert answer.status_code == 200, answer.text
        return [token["id"] for token in answer.json()["tokens"]]

    for messages in CONVERSATIONS:
        answer = requests.post(
            f"{server.url}/v1/chat/completions/render",
            json={"model": model_name, "messages": messages},
            timeout=30,
        )
        assert answer.status_code == 200, answer.text
        rendered = answer.json()
        assert rendered["token_ids"] == ids({"messages": messages})
        completion = client.chat.completions.create(
            model=model_name, messages=messages, max_tokens=1, temperature=0
        )
        assert completion.usage is not None
        assert completion.usage.prompt_tokens == len(rendered["token_ids"])
    answer = requests.post(
        f"{server.url}/v1/completions/render",
        json={"model": model_name, "prompt": [PROMPT, "Hello"]},
        timeout=30,
    )
    assert answer.status_code == 200, answer.text
    assert [r["token_ids"] for r in answer.json()] == [ids({"prompt": PROMPT}), ids({"prompt": "Hello"})]


def test_loads_report_the_pool_in_tokens(server: Server) -> None:
    kv = server.info()["kv"]
    loads = requests.get(f"{server.url}/v1/loads?include=core", timeout=30).json()
    assert loads["dp_rank_count"] == 1
    (load,) = loads["loads"]
    assert load["max_total_num_tokens"] == kv["total_blocks"] * kv["block_size"]
    assert 0.0 <= load["token_usage"] <= 1.0
