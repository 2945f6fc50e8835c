"""End to end: Anthropic's Messages API with the official `anthropic` SDK against the default 135M model.
Greedy answers streamed and not agree, and the raw stream is exactly Anthropic's event sequence;
`stop_sequences` end the answer at the matched string; `tool_choice` `any` and `tool` always give `tool_use`
blocks whose `input` validates against the tool's `input_schema` (`jsonschema`), streamed as written in
several `input_json_delta`s that reassemble into the same input; a full round trip through a tool;
count_tokens equals the usage's prompt tokens; a repeated prompt is read from the prefix cache; bad requests
are `BadRequestError`s naming the problem. A second server (`--reasoning-parser deepseek_r1`, `--api-key`)
puts the thinking into `thinking` blocks and takes the key in `x-api-key`."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import anthropic
import jsonschema
import pytest
import requests

from .conftest import Server, start_server, stop_server

WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city.",
    "input_schema": {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 20},
            "unit": {"enum": ["celsius", "fahrenheit"]},
        },
        "required": ["city", "unit"],
        "additionalProperties": False,
    },
}
TIME = {
    "name": "get_time",
    "input_schema": {
        "type": "object",
        "properties": {"zone": {"enum": ["UTC", "CET"]}},
        "required": ["zone"],
        "additionalProperties": False,
    },
}
TOOLS = [WEATHER, TIME]
SCHEMAS = {tool["name"]: tool["input_schema"] for tool in TOOLS}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
MODEL = "SmolLM2-135M-Instruct"
API_KEY = "k3y-for-tests"
# The SDK no longer has sampling parameters (newer Claude models fix them); the API still takes them.
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def client(server: Server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)


def raw_events(url: str, body: dict, headers: dict[str, str] | None = None) -> list[tuple[str, dict]]:
    """The SSE events of a streamed request (SDK keyword arguments), as (event name, data), pings included."""
    fields = {name: value for name, value in body.items() if name != "extra_body"}
    body = {**fields, **body.get("extra_body", {}), "stream": True}
    response = requests.post(f"{url}/v1/messages", json=body, headers=headers, timeout=120)
    assert response.status_code == 200, response.text
    events, name = [], None
    for line in response.text.splitlines():
        if line.startswith("event:"):
            name = line.removeprefix("event:").strip()
        elif line.startswith("data:"):
            data = json.loads(line.removeprefix("data:"))
            assert data["type"] == name, (name, data)
            events.append((name, data))
    return events


def test_a_message_and_its_stream_agree(client: anthropic.Anthropic, server: Server) -> None:
    fields = dict(model=MODEL, max_tokens=24, system="Answer briefly.", messages=MESSAGES, extra_body=GREEDY)
    whole = client.messages.create(**fields)
    assert whole.type == "message" and whole.role == "assistant" and whole.id.startswith("msg_"), whole
    assert whole.model == MODEL
    assert [block.type for block in whole.content] == ["text"], whole
    assert whole.stop_reason in ("end_turn", "max_tokens") and whole.stop_sequence is None, whole
    assert whole.usage.output_tokens <= 24 and whole.usage.input_tokens > 0, whole.usage

    with client.messages.stream(**fields) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == whole.content[0].text
    assert [(block.type, block.text) for block in final.content] == [("text", whole.content[0].text)]
    assert final.stop_reason == whole.stop_reason
    assert final.usage.output_tokens == whole.usage.output_tokens

    events = raw_events(server.url, fields)
    names = [name for name, _ in events]
    num_deltas = len(names) - 6
    assert num_deltas >= 1, names
    expected = ["message_start", "content_block_start", "ping", *["content_block_delta"] * num_deltas,
                "content_block_stop", "message_delta", "message_stop"]  # fmt: skip
    assert names == expected
    started = events[0][1]["message"]
    assert started["content"] == [] and started["stop_reason"] is None, started
    opening = {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}
    assert events[1][1] == opening
    assert all(data["delta"]["type"] == "text_delta" and data["index"] == 0 for _, data in events[3:-3])
    assert "".join(data["delta"]["text"] for _, data in events[3:-3]) == whole.content[0].text
    delta = events[-2][1]
    assert delta["delta"] == {"stop_reason": whole.stop_reason, "stop_sequence": None}, delta
    assert delta["usage"]["output_tokens"] == whole.usage.output_tokens


def test_stop_sequences_end_the_answer_at_the_matched_string(client: anthropic.Anthropic) -> None:
    fields = dict(model=MODEL, max_tokens=32, messages=MESSAGES, extra_body=GREEDY)
    free = client.messages.create(**fields).content[0].text
    words = free.split()
    assert len(words) >= 4, free
    # A word from the second half whose first occurrence (where generation stops) has text before it.
    stop = next(word for word in words[len(words) // 2 :] if free[: free.index(word)].strip())
    stopped = client.messages.create(**fields, stop_sequences=["never-generated", stop])
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == stop, stopped
    assert stopped.content[0].text == free[: free.index(stop)]


def check_tool_uses(message: anthropic.types.Message, names: set[str]) -> list:
    uses = [block for block in message.content if block.type == "tool_use"]
    assert uses and message.stop_reason == "tool_use", message
    for use in uses:
        assert use.id.startswith("toolu_") and use.name in names, use
        jsonschema.validate(use.input, SCHEMAS[use.name])
    return uses


def test_any_and_named_tool_choices_always_call_valid_tools(client: anthropic.Anthropic) -> None:
    """Sampled at the default temperature 1 (Anthropic's API has no seed), one call each. `max_tokens` leaves
    room for the longest arguments the schemas allow (a 20-character city of escaped characters), so only
    an invalid call could fail."""
    for _ in range(4):
        some = client.messages.create(
            model=MODEL, max_tokens=300, messages=MESSAGES, tools=TOOLS,
            tool_choice={"type": "any", "disable_parallel_tool_use": True},
        )  # fmt: skip
        assert len(check_tool_uses(some, {"get_weather", "get_time"})) == 1
        named = client.messages.create(
            model=MODEL, max_tokens=200, messages=MESSAGES, tools=TOOLS,
            tool_choice={"type": "tool", "name": "get_time", "disable_parallel_tool_use": True},
        )  # fmt: skip
        assert len(check_tool_uses(named, {"get_time"})) == 1


def test_streamed_input_json_deltas_reassemble(client: anthropic.Anthropic, server: Server) -> None:
    fields = dict(model=MODEL, max_tokens=120, messages=MESSAGES, tools=TOOLS, extra_body=GREEDY)
    fields["tool_choice"] = {"type": "any"}
    whole = client.messages.create(**fields)
    uses = check_tool_uses(whole, {"get_weather", "get_time"})
    events = raw_events(server.url, fields)
    pieces: dict[int, list[str]] = {}
    for i, (name, data) in enumerate(events):
        if name == "content_block_start" and data["content_block"]["type"] == "tool_use":
            assert data["content_block"]["input"] == {}, data
            # The block is open while its arguments are written: pieces of them, then its end.
            index = data["index"]
            following = [event for event in events[i + 1 :] if event[1].get("index") == index]
            num_pieces = next(j for j, (name, _) in enumerate(following) if name != "content_block_delta")
            assert following[num_pieces] == (
                "content_block_stop",
                {"type": "content_block_stop", "index": index},
            )
            assert all(data["delta"]["type"] == "input_json_delta" for _, data in following[:num_pieces])
            pieces[index] = [data["delta"]["partial_json"] for _, data in following[:num_pieces]]
    # The arguments arrive as the model writes them, in more than one piece each.
    assert all(len(streamed) > 1 for streamed in pieces.values()), pieces
    streamed = [json.loads("".join(pieces[index])) for index in sorted(pieces)]
    assert streamed == [use.input for use in uses]
    with client.messages.stream(**fields) as stream:
        final = stream.get_final_message()
    final_uses = [(block.name, block.input) for block in final.content if block.type == "tool_use"]
    assert final_uses == [(use.name, use.input) for use in uses]


def test_a_round_trip_through_a_tool(client: anthropic.Anthropic) -> None:
    first = client.messages.create(
        model=MODEL, max_tokens=60, messages=MESSAGES, tools=TOOLS, extra_body=GREEDY,
        tool_choice={"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True},
    )  # fmt: skip
    (use,) = check_tool_uses(first, {"get_weather"})
    history = [
        *MESSAGES,
        {"role": "assistant", "content": [block.model_dump() for block in first.content]},
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": use.id, "content": '{"celsius": 21}'}],
        },
    ]
    for choice in ({"type": "auto"}, {"type": "none"}):
        answer = client.messages.create(
            model=MODEL, max_tokens=40, messages=history, tools=TOOLS, tool_choice=choice, extra_body=GREEDY
        )
        assert answer.stop_reason in ("end_turn", "max_tokens", "tool_use"), answer
        assert answer.content, answer
    assert [block.type for block in answer.content] == ["text"], answer


def test_count_tokens_and_cache_reads(client: anthropic.Anthropic) -> None:
    system = "You are a weather assistant. " * 20  # several KV blocks, so a repeat finds them cached
    fields = dict(model=MODEL, system=system, messages=MESSAGES, tools=TOOLS)
    counted = client.messages.count_tokens(**fields).input_tokens
    # Claude Code's beta client posts to `/v1/messages/count_tokens?beta=true`.
    assert client.beta.messages.count_tokens(**fields).input_tokens == counted
    first = client.messages.create(**fields, max_tokens=4, extra_body=GREEDY)
    second = client.messages.create(**fields, max_tokens=4, extra_body=GREEDY)
    for usage in (first.usage, second.usage):
        assert usage.input_tokens + usage.cache_read_input_tokens == counted, usage
        assert usage.cache_creation_input_tokens == 0, usage
    assert second.usage.cache_read_input_tokens > 0, second.usage
    assert second.usage.input_tokens < counted, second.usage


def test_output_config_format_gives_json_that_validates(client: anthropic.Anthropic) -> None:
    schema = SCHEMAS["get_weather"]
    message = client.messages.create(
        model=MODEL, max_tokens=60, messages=MESSAGES,
        output_config={"format": {"type": "json_schema", "schema": schema}},
    )  # fmt: skip
    assert message.stop_reason == "end_turn", message
    jsonschema.validate(json.loads(message.content[0].text), schema)


def test_bad_requests_are_400s_naming_the_problem(client: anthropic.Anthropic) -> None:
    with pytest.raises(anthropic.BadRequestError, match="max_tokens"):
        client.post("/v1/messages", cast_to=object, body={"model": MODEL, "messages": MESSAGES})
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}
    with pytest.raises(anthropic.BadRequestError, match=r"messages\[0\]\.content\[1\]. is an .image. block"):
        client.messages.create(
            model=MODEL, max_tokens=4,
            messages=[{"role": "user", "content": [{"type": "text", "text": "What is this?"}, image]}],
        )  # fmt: skip
    with pytest.raises(anthropic.BadRequestError, match="tool_choice") as refused:
        client.messages.create(
            model=MODEL, max_tokens=4, messages=MESSAGES, tools=TOOLS, tool_choice={"type": "sometimes"}
        )
    assert refused.value.body["type"] == "error", refused.value.body
    assert refused.value.body["error"]["type"] == "invalid_request_error", refused.value.body
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(model="claude-sonnet-4-5", max_tokens=4, messages=MESSAGES)
    # The server carries on.
    assert client.messages.create(model=MODEL, max_tokens=2, messages=MESSAGES).content


@pytest.fixture(scope="module")
def thinking_server(default_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    server = start_server(
        default_model, tmp_path_factory.mktemp("thinking"), "--reasoning-parser", "deepseek_r1",
        "--api-key", API_KEY,
    )  # fmt: skip
    yield server
    stop_server(server)


def test_thinking_lands_in_thinking_blocks_and_the_key_in_x_api_key(thinking_server: Server) -> None:
    """DeepSeek-R1's convention: the answer starts inside the thinking, which ends at `</think>`. The 135M
    model never writes one, so every word is thinking."""
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=thinking_server.url, api_key="wrong", max_retries=0).messages.create(
            model=MODEL, max_tokens=2, messages=MESSAGES
        )
    client = anthropic.Anthropic(base_url=thinking_server.url, api_key=API_KEY, max_retries=0)
    thinking = {"type": "enabled", "budget_tokens": 16}
    fields = dict(model=MODEL, max_tokens=24, messages=MESSAGES, extra_body=GREEDY, thinking=thinking)
    whole = client.messages.create(**fields)
    assert [block.type for block in whole.content] == ["thinking"], whole
    assert whole.content[0].thinking and whole.content[0].signature == "", whole
    events = raw_events(thinking_server.url, fields, headers={"x-api-key": API_KEY})
    deltas = [data["delta"] for name, data in events if name == "content_block_delta"]
    assert {delta["type"] for delta in deltas[:-1]} == {"thinking_delta"}, deltas
    assert deltas[-1] == {"type": "signature_delta", "signature": ""}
    assert "".join(delta["thinking"] for delta in deltas[:-1]) == whole.content[0].thinking
    with client.messages.stream(**fields) as stream:
        assert stream.get_final_message().content == whole.content
