"""End to end: what today's OpenAI clients send no longer fails. The official `openai` client sends the
harmless fields (`tools=None`, `response_format={"type": "text"}`, `store`, `parallel_tool_calls`,
`reasoning_effort`, `stream_options.continuous_usage_stats`, `chat_template_kwargs`, unknown extras), a
browser's CORS preflight from an allowed origin succeeds, and `GET /v1/models/{id}` answers."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import requests

from .conftest import Server, start_server, stop_server

ORIGIN = "https://ui.example"
MESSAGES = [{"role": "user", "content": "Say hi."}]


@pytest.fixture(scope="module")
def compat_server(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    server = start_server(tiny_model, tmp_path_factory.mktemp("compat"), "--cors-allow-origin", ORIGIN)
    yield server
    stop_server(server)


@pytest.fixture(scope="module")
def client(compat_server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{compat_server.url}/v1", api_key="unused", max_retries=0)


def test_harmless_fields_from_the_openai_client_are_accepted(client: openai.OpenAI, tiny_model: Path) -> None:
    reply = client.chat.completions.create(
        model=tiny_model.name,
        messages=MESSAGES,
        max_tokens=3,
        temperature=0,
        tools=None,
        tool_choice="none",
        parallel_tool_calls=True,
        response_format={"type": "text"},
        store=False,
        reasoning_effort="low",
        metadata=None,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}, "not_a_field": 1},
    )
    assert reply.choices[0].finish_reason in ("stop", "length")
    assert reply.usage is not None and reply.usage.completion_tokens <= 3


def test_continuous_usage_stats_stream_usage_on_every_chunk(client: openai.OpenAI, tiny_model: Path) -> None:
    chunks = list(
        client.chat.completions.create(
            model=tiny_model.name,
            messages=MESSAGES,
            max_tokens=3,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True, "continuous_usage_stats": True},
        )
    )
    token_chunks = [c for c in chunks if c.choices and c.choices[0].delta.role is None]
    assert token_chunks and all(c.usage is not None for c in token_chunks)
    assert [c.usage.completion_tokens for c in token_chunks] == list(range(1, len(token_chunks) + 1))
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == len(token_chunks)


def test_fields_asking_for_what_rill_does_not_do_get_a_422_naming_them(
    client: openai.OpenAI, tiny_model: Path
) -> None:
    with pytest.raises(openai.UnprocessableEntityError) as error:
        client.chat.completions.create(model=tiny_model.name, messages=MESSAGES, max_tokens=1, store=True)
    assert "`store`" in str(error.value)


def test_one_model_by_id(client: openai.OpenAI, tiny_model: Path) -> None:
    assert client.models.retrieve(tiny_model.name).id == tiny_model.name
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")


def test_cors_preflight_from_an_allowed_origin(compat_server: Server) -> None:
    headers = {
        "Origin": ORIGIN,
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization,content-type",
    }
    response = requests.options(f"{compat_server.url}/v1/chat/completions", headers=headers, timeout=10)
    assert response.ok, response.status_code
    assert response.headers["access-control-allow-origin"] == ORIGIN
    url = f"{compat_server.url}/v1/chat/completions"
    other = requests.options(url, headers={**headers, "Origin": "https://evil.example"}, timeout=10)
    assert "access-control-allow-origin" not in other.headers
