"""End to end: the Responses API (`/v1/responses`) with the default model, through the official `openai`
SDK's `client.responses` and the OpenAI Agents SDK (`openai-agents`).

Checked: a response streamed (the exact event sequence, increasing `sequence_number`s) equals the same
response not streamed at temperature 0; `instructions` reach the prompt; retrieve, delete, `input_items`;
`previous_response_id` continues the stored token history (turn k+1's prompt is exactly turn k's tokens
plus the new turn's, and the prefix cache holds all of turn k's full blocks); function calls under
`tool_choice="required"` validate against their schemas and their results continue the conversation; a
server with a tiny store evicts its oldest response with a clear error; bad input is a 400 naming the
field; an Agents SDK agent calls its function tool and answers, with and without response chaining."""

from __future__ import annotations

import asyncio
import itertools
import json
from collections.abc import Iterator
from pathlib import Path

import jsonschema
import openai
import pytest
import requests

from .conftest import Server, start_server, stop_server

MODEL = "SmolLM2-135M-Instruct"
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city.",
    "parameters": {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 20},
            "unit": {"enum": ["celsius", "fahrenheit"]},
        },
        "required": ["city", "unit"],
        "additionalProperties": False,
    },
    "strict": True,
}


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def tokenize(server: Server, text: str) -> int:
    """How many tokens `text` is, special tokens in it included but none added."""
    body = {"prompt": text, "add_special_tokens": False}
    answer = requests.post(f"{server.url}/tokenize", json=body, timeout=30)
    answer.raise_for_status()
    return answer.json()["count"]


def test_streamed_equals_not_streamed(client: openai.OpenAI) -> None:
    kwargs = {"model": MODEL, "input": "Name three colors.", "max_output_tokens": 24, "temperature": 0}
    whole = client.responses.create(**kwargs)
    assert whole.id.startswith("resp_") and whole.object == "response"
    assert whole.status in ("completed", "incomplete"), whole
    if whole.status == "incomplete":
        assert whole.incomplete_details.reason == "max_output_tokens"
    assert [item.type for item in whole.output] == ["message"]
    message = whole.output[0]
    assert message.role == "assistant" and message.id.startswith("msg_")
    assert [part.type for part in message.content] == ["output_text"] and message.content[0].annotations == []
    assert whole.output_text == message.content[0].text and whole.output_text
    usage = whole.usage
    assert usage.output_tokens <= 24 and usage.total_tokens == usage.input_tokens + usage.output_tokens
    assert usage.output_tokens_details.reasoning_tokens == 0
    assert (whole.temperature, whole.max_output_tokens, whole.store, whole.model) == (0, 24, True, MODEL)

    events = list(client.responses.create(**kwargs, stream=True))
    types = [event.type for event in events]
    num_deltas = types.count("response.output_text.delta")
    final = "response.completed" if whole.status == "completed" else "response.incomplete"
    assert types == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        *["response.output_text.delta"] * num_deltas,
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        final,
    ]
    assert [event.sequence_number for event in events] == list(range(len(events)))
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    deltas = "".join(event.delta for event in events if event.type == "response.output_text.delta")
    assert deltas == whole.output_text == events[-4].text
    streamed = events[-1].response
    assert streamed.status == whole.status and streamed.output_text == whole.output_text
    assert streamed.usage.output_tokens == whole.usage.output_tokens
    assert streamed.usage.input_tokens == whole.usage.input_tokens
    # The item ids agree within the stream.
    item_id = events[2].item.id
    assert all(event.item_id == item_id for event in events[3:-2])
    assert events[-2].item.id == item_id == streamed.output[0].id


def test_instructions_are_the_system_message(server: Server, client: openai.OpenAI) -> None:
    response = client.responses.create(
        model=MODEL, instructions="Answer in French.", input="Hello!", max_output_tokens=8, temperature=0
    )
    assert response.instructions == "Answer in French."
    messages = [{"role": "system", "content": "Answer in French."}, {"role": "user", "content": "Hello!"}]
    rendered = requests.post(f"{server.url}/tokenize", json={"messages": messages}, timeout=30).json()
    assert response.usage.input_tokens == rendered["count"]


def test_retrieve_delete_and_input_items(client: openai.OpenAI) -> None:
    items = [
        {"role": "developer", "content": "Be brief."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Say yes."}]},
    ]
    created = client.responses.create(
        model=MODEL, input=items, max_output_tokens=6, temperature=0, metadata={"run": "e2e"}
    )
    assert created.metadata == {"run": "e2e"}
    retrieved = client.responses.retrieve(created.id)
    assert retrieved.model_dump() == created.model_dump()
    listed = client.responses.input_items.list(created.id, order="asc")
    assert [(item.type, item.role) for item in listed.data] == [("message", "developer"), ("message", "user")]
    assert listed.data[0].content[0].text == "Be brief." and listed.data[1].content[0].text == "Say yes."
    newest_first = client.responses.input_items.list(created.id, limit=1)
    assert [item.id for item in newest_first.data] == [listed.data[1].id] and newest_first.has_more
    with pytest.raises(openai.BadRequestError, match="background"):
        client.responses.cancel(created.id)
    client.responses.delete(created.id)
    with pytest.raises(openai.NotFoundError, match=created.id):
        client.responses.retrieve(created.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(created.id)
    with pytest.raises(openai.BadRequestError) as error:
        client.responses.create(
            model=MODEL, previous_response_id=created.id, input="And?", max_output_tokens=4
        )
    assert error.value.code == "previous_response_not_found" and error.value.param == "previous_response_id"
    assert created.id in error.value.message


def test_unstored_responses_cannot_be_retrieved_or_continued(client: openai.OpenAI) -> None:
    response = client.responses.create(
        model=MODEL, input="Hi", store=False, max_output_tokens=4, temperature=0
    )
    assert response.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(response.id)
    with pytest.raises(openai.BadRequestError, match="previous_response_not_found|not found"):
        client.responses.create(
            model=MODEL, previous_response_id=response.id, input="Hi", max_output_tokens=4
        )


def closing(previous: openai.types.responses.Response) -> str:
    """What the ChatML template (the default model's) still writes after a previous answer: its end of
    turn `<|im_end|>\\n`, less the `<|im_end|>` the model generated when it ended on its own."""
    return "\n" if previous.status == "completed" else "<|im_end|>\n"


def test_previous_response_id_continues_the_token_history(server: Server, client: openai.OpenAI) -> None:
    block_size = server.info()["kv"]["block_size"]
    turns = ["My name is Ada. Say hello to me.", "What is my name?", "Spell it backwards."]
    previous = None
    for text in turns:
        response = client.responses.create(
            model=MODEL,
            input=text,
            previous_response_id=previous.id if previous else None,
            max_output_tokens=20,
            temperature=0,
        )
        assert response.previous_response_id == (previous.id if previous else None)
        if previous is not None:
            # Exactly the stored tokens (prompt + answer), then the new turn alone.
            history = previous.usage.input_tokens + previous.usage.output_tokens
            new_turn = f"{closing(previous)}<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"
            assert response.usage.input_tokens == history + tokenize(server, new_turn)
            # Every full block of the history is a prefix hit (the last answer token's K/V was never
            # computed: the model stopped right after sampling it).
            cached = response.usage.input_tokens_details.cached_tokens
            assert cached >= (history - 1) // block_size * block_size, (cached, history, block_size)
            assert cached < response.usage.input_tokens
        previous = response
    # The conversation is the same as re-rendered: the last answer knows the first turn.
    listed = client.responses.input_items.list(previous.id)
    assert [item.content[0].text for item in listed.data] == [turns[-1]]


def check_call(item: object) -> None:
    assert item.type == "function_call" and item.name == "get_weather" and item.status == "completed"
    assert item.call_id.startswith("call_") and item.id.startswith("fc_")
    jsonschema.validate(json.loads(item.arguments), WEATHER["parameters"])


def test_function_calls_and_their_results(server: Server, client: openai.OpenAI) -> None:
    kwargs = {
        "model": MODEL,
        "input": "What is the weather in Paris?",
        "tools": [WEATHER],
        "tool_choice": "required",
        "parallel_tool_calls": False,
        "max_output_tokens": 60,
        "temperature": 0,
    }
    first = client.responses.create(**kwargs)
    assert first.status == "completed" and [item.type for item in first.output] == ["function_call"]
    call = first.output[0]
    check_call(call)
    assert first.tools[0].name == "get_weather" and first.tool_choice == "required"

    events = list(client.responses.create(**kwargs, stream=True))
    types = [event.type for event in events]
    # The arguments arrive as the model writes them, in more than one piece.
    num_deltas = types.count("response.function_call_arguments.delta")
    assert num_deltas > 1, types
    assert types == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        *["response.function_call_arguments.delta"] * num_deltas,
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    added = events[2].item
    assert (added.id, added.call_id, added.name) == (events[-2].item.id, events[-2].item.call_id, call.name)
    assert (added.arguments, added.status) == ("", "in_progress")
    pieces = "".join(event.delta for event in events[3 : 3 + num_deltas])
    assert pieces == events[-3].arguments == events[-2].item.arguments == call.arguments
    check_call(events[-1].response.output[0])

    result = {"type": "function_call_output", "call_id": call.call_id, "output": json.dumps({"sky": "sunny"})}
    second = client.responses.create(
        model=MODEL,
        previous_response_id=first.id,
        input=[result],
        tools=[WEATHER],
        max_output_tokens=30,
        temperature=0,
    )
    assert second.status in ("completed", "incomplete") and second.output
    history = first.usage.input_tokens + first.usage.output_tokens
    assert second.usage.input_tokens > history
    cached = second.usage.input_tokens_details.cached_tokens
    assert cached >= (history - 1) // server.info()["kv"]["block_size"] * server.info()["kv"]["block_size"]


def test_bad_input_is_a_400_naming_the_field(client: openai.OpenAI) -> None:
    image = [{"role": "user", "content": [{"type": "input_image", "image_url": "https://example.com/a.png"}]}]
    with pytest.raises(openai.BadRequestError) as error:
        client.responses.create(model=MODEL, input=image)
    assert error.value.param == "input[0].content[0]" and "input_image" in error.value.message
    with pytest.raises(openai.BadRequestError) as error:
        client.responses.create(model=MODEL, input="hi", tools=[{"type": "web_search"}])
    assert error.value.param == "tools" and "tools[0].type" in error.value.message
    with pytest.raises(openai.BadRequestError) as error:
        client.responses.create(model=MODEL, input="hi", tools=[WEATHER], tool_choice={"type": "file_search"})
    assert error.value.param == "tool_choice"
    with pytest.raises(openai.UnprocessableEntityError) as error:
        client.responses.create(model=MODEL, input="hi", background=True)
    assert error.value.param == "background"
    # The server carries on.
    assert client.responses.create(model=MODEL, input="hi", max_output_tokens=2).usage.output_tokens <= 2


@pytest.fixture(scope="module")
def small_store(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """The tiny model with a store of two responses, and a reasoning parser whose answers start inside the
    thinking (the tiny model never closes it: all its text is thinking)."""
    srv = start_server(
        tiny_model,
        tmp_path_factory.mktemp("small-store"),
        "--responses-store-max-entries",
        "2",
        "--reasoning-parser",
        "deepseek_r1",
    )
    yield srv
    stop_server(srv)


def test_the_store_evicts_its_oldest_response(small_store: Server) -> None:
    client = openai.OpenAI(base_url=f"{small_store.url}/v1", api_key="unused", max_retries=0)
    model = small_store.info()["served_model_name"]
    ids = [client.responses.create(model=model, input=f"turn {i}", max_output_tokens=2).id for i in range(3)]
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(ids[0])
    assert [client.responses.retrieve(id).id for id in ids[1:]] == ids[1:]
    with pytest.raises(openai.BadRequestError) as error:
        client.responses.create(model=model, previous_response_id=ids[0], input="more", max_output_tokens=2)
    assert error.value.code == "previous_response_not_found" and ids[0] in error.value.message
    assert "evicted" in error.value.message
    store = small_store.info()["responses_store"]
    assert (store["max_entries"], store["num_entries"]) == (2, 2)
    metrics = requests.get(f"{small_store.url}/metrics", timeout=10).text
    assert "rill_responses_stored 2" in metrics.splitlines()


def test_thinking_is_a_reasoning_item(small_store: Server) -> None:
    client = openai.OpenAI(base_url=f"{small_store.url}/v1", api_key="unused", max_retries=0)
    kwargs = {"model": small_store.info()["served_model_name"], "input": "Think.", "max_output_tokens": 8}
    whole = client.responses.create(**kwargs, temperature=0, store=False)
    assert whole.status == "incomplete" and [item.type for item in whole.output] == ["reasoning"]
    reasoning = whole.output[0]
    assert reasoning.id.startswith("rs_") and reasoning.summary == [] and reasoning.status == "incomplete"
    assert [part.type for part in reasoning.content] == ["reasoning_text"] and reasoning.content[0].text
    assert 0 < whole.usage.output_tokens_details.reasoning_tokens <= 8
    events = list(client.responses.create(**kwargs, temperature=0, store=False, stream=True))
    types = [event.type for event in events]
    num_deltas = types.count("response.reasoning_text.delta")
    assert types == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        *["response.reasoning_text.delta"] * num_deltas,
        "response.reasoning_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]
    deltas = "".join(event.delta for event in events if event.type == "response.reasoning_text.delta")
    assert deltas == reasoning.content[0].text == events[-1].response.output[0].content[0].text


def test_an_agents_sdk_agent_calls_its_tool(server: Server) -> None:
    agents = pytest.importorskip("agents")
    called: list[str] = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        called.append(city)
        return f"It is sunny in {city}."

    model = agents.OpenAIResponsesModel(
        model=MODEL,
        openai_client=openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0),
    )
    agents.set_tracing_disabled(True)
    # The 135M model does not call tools by itself: `required` forces the first call, and the SDK resets
    # the choice to `auto` once a tool ran, so the next turn answers.
    agent = agents.Agent(
        name="weather",
        instructions="You answer questions about the weather.",
        tools=[get_weather],
        model=model,
        model_settings=agents.ModelSettings(
            tool_choice="required", parallel_tool_calls=False, max_tokens=60, temperature=0
        ),
    )

    async def run_twice() -> list[tuple[agents.RunResult, list[str]]]:
        """A run with the whole history resent each turn, then one chained by `previous_response_id`
        (one event loop for both: the client's connections belong to it)."""
        runs = []
        for chained in (False, True):
            called.clear()
            result = await agents.Runner.run(
                agent, "What is the weather in Paris?", max_turns=4, auto_previous_response_id=chained
            )
            runs.append((result, list(called)))
        return runs

    block_size = server.info()["kv"]["block_size"]
    for chained, (result, calls) in zip((False, True), asyncio.run(run_twice()), strict=True):
        assert calls, "the tool never ran"
        assert isinstance(result.final_output, str) and result.final_output
        responses = result.raw_responses
        assert len(responses) >= 2
        if chained:
            # Each turn after the first continued the previous one's stored token history.
            for previous, response in itertools.pairwise(responses):
                history = previous.usage.input_tokens + previous.usage.output_tokens
                assert response.usage.input_tokens > history
                cached = response.usage.input_tokens_details.cached_tokens
                assert cached >= (history - 1) // block_size * block_size
