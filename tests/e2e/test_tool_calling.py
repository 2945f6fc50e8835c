"""End to end: tool calling and reasoning with the default 135M model, whose template has no tool support
(so Rill offers the tools the Hermes way). With the official `openai` client: `tool_choice="required"` and a
named tool always give calls whose arguments validate against the tool's schema (`jsonschema`), and so does
`auto` (free text, but once the model writes `<tool_call>` the grammar holds it to valid calls) over 50
sampled requests; a full round trip (assistant `tool_calls`, then a `tool` message, then an answer), and
streamed tool-call arguments that arrive in several pieces and reassemble into the non-streamed calls;
`langchain-openai` completes a forced tool call; bad tools and pathological schemas are quick 400s naming the
problem. A model whose tokenizer has Mistral's markers as special tokens gets its calls read, through chat
and the Anthropic API. A server with `--reasoning-parser deepseek_r1` puts the answer's thinking into
`reasoning_content`, streamed and not alike."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import jsonschema
import openai
import pytest
import requests

from .conftest import Server, start_server, stop_server

WEATHER = {
    "type": "function",
    "function": {
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
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"enum": ["UTC", "CET"]}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER, TIME]
SCHEMAS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def check_calls(calls: list, names: set[str]) -> None:
    assert calls, "no tool calls"
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_"), call
        assert call.function.name in names, call
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_required_and_named_choices_always_call_valid_tools(client: openai.OpenAI) -> None:
    for seed in range(6):
        required = client.chat.completions.create(
            model="SmolLM2-135M-Instruct",
            messages=MESSAGES,
            tools=TOOLS,
            tool_choice="required",
            max_tokens=300,
            seed=seed,
            temperature=1.0,
        ).choices[0]
        assert required.finish_reason == "tool_calls", required
        check_calls(required.message.tool_calls, {"get_weather", "get_time"})
        named = client.chat.completions.create(
            model="SmolLM2-135M-Instruct",
            messages=MESSAGES,
            tools=TOOLS,
            parallel_tool_calls=False,
            tool_choice={"type": "function", "function": {"name": "get_time"}},
            max_tokens=60,
            seed=seed,
            temperature=1.0,
        ).choices[0]
        assert named.finish_reason == "tool_calls", named
        assert named.message.content is None and len(named.message.tool_calls) == 1
        check_calls(named.message.tool_calls, {"get_time"})


def test_auto_calls_are_always_valid(client: openai.OpenAI) -> None:
    """50 seeded answers at temperature 1 under `auto`: each either answers in text (which never holds the
    trigger) or makes calls, and every call validates against its tool's schema."""
    # An instruction, and one call and its answer earlier in the conversation, invite the small model to
    # call again.
    instruction = "Use the get_weather tool: call it for {}. Reply with <tool_call> only."
    earlier_call = {
        "id": "call_0",
        "type": "function",
        "function": {"name": "get_weather", "arguments": json.dumps({"city": "Rome", "unit": "celsius"})},
    }
    messages = [
        {"role": "user", "content": instruction.format("Rome")},
        {"role": "assistant", "content": None, "tool_calls": [earlier_call]},
        {"role": "tool", "tool_call_id": "call_0", "content": json.dumps({"temperature": 20})},
        {"role": "assistant", "content": "It is 20 degrees in Rome."},
        {"role": "user", "content": instruction.format("Paris")},
    ]

    def ask(seed: int) -> openai.types.chat.chat_completion.Choice:
        return client.chat.completions.create(
            model="SmolLM2-135M-Instruct",
            messages=messages,
            tools=TOOLS,
            max_tokens=80,
            seed=seed,
            temperature=1.0,
        ).choices[0]

    with ThreadPoolExecutor(max_workers=16) as pool:
        choices = list(pool.map(ask, range(50)))
    num_calling = 0
    for choice in choices:
        if choice.message.tool_calls:
            num_calling += 1
            check_calls(choice.message.tool_calls, {"get_weather", "get_time"})
            assert choice.finish_reason in ("tool_calls", "length"), choice
        else:
            # Free text never holds the trigger, unless it is a call that `max_tokens` cut off.
            assert "<tool_call>" not in (choice.message.content or "") or choice.finish_reason == "length", (
                choice
            )
    print(f"{num_calling} of 50 answers under auto made calls")
    assert num_calling >= 5, f"only {num_calling} of 50 answers made calls"


def test_a_round_trip_through_a_tool(client: openai.OpenAI) -> None:
    first = (
        client.chat.completions.create(
            model="SmolLM2-135M-Instruct",
            messages=MESSAGES,
            tools=TOOLS,
            parallel_tool_calls=False,
            tool_choice={"type": "function", "function": {"name": "get_weather"}},
            max_tokens=60,
            temperature=0,
        )
        .choices[0]
        .message
    )
    call = first.tool_calls[0]
    history = [
        *MESSAGES,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 21, "sky": "sunny"})},
    ]
    for choice in ("auto", "none"):
        answer = client.chat.completions.create(
            model="SmolLM2-135M-Instruct",
            messages=history,
            tools=TOOLS,
            tool_choice=choice,
            max_tokens=40,
            temperature=0,
        ).choices[0]
        assert answer.finish_reason in ("stop", "length", "tool_calls"), answer
        assert answer.message.content or answer.message.tool_calls, answer
    assert answer.message.content and not answer.message.tool_calls, answer


def test_streamed_tool_calls_reassemble_into_the_unstreamed_ones(client: openai.OpenAI) -> None:
    fields = dict(
        model="SmolLM2-135M-Instruct",
        messages=MESSAGES,
        tools=TOOLS,
        tool_choice="required",
        max_tokens=120,
        seed=3,
        temperature=1.0,
    )
    whole = client.chat.completions.create(**fields).choices[0]
    calls: dict[int, dict] = {}
    finish_reason = None
    content = ""
    for chunk in client.chat.completions.create(**fields, stream=True):
        for choice in chunk.choices:
            content += choice.delta.content or ""
            finish_reason = choice.finish_reason or finish_reason
            for delta in choice.delta.tool_calls or []:
                call = calls.setdefault(delta.index, {"id": "", "name": "", "arguments": "", "num_pieces": 0})
                assert (delta.function.name is not None) == (call["num_pieces"] == 0), delta
                call["num_pieces"] += 1
                call["id"] += delta.id or ""
                call["name"] += delta.function.name or ""
                call["arguments"] += delta.function.arguments or ""
    assert finish_reason == whole.finish_reason == "tool_calls"
    assert content == (whole.message.content or "")
    assert all(calls[i]["num_pieces"] > 1 for i in calls), calls
    streamed = [(calls[i]["name"], calls[i]["arguments"]) for i in sorted(calls)]
    assert streamed == [(c.function.name, c.function.arguments) for c in whole.message.tool_calls]
    assert all(calls[i]["id"].startswith("call_") for i in calls)


def test_langchain_completes_a_tool_call(server: Server) -> None:
    from langchain_openai import ChatOpenAI

    model = ChatOpenAI(
        base_url=f"{server.url}/v1",
        api_key="unused",
        model="SmolLM2-135M-Instruct",
        max_tokens=60,
        temperature=0,
        max_retries=0,
    )
    message = model.bind_tools([WEATHER], tool_choice="get_weather").invoke("What is the weather in Paris?")
    assert [call["name"] for call in message.tool_calls] == ["get_weather"], message
    jsonschema.validate(message.tool_calls[0]["args"], SCHEMAS["get_weather"])


def test_bad_tools_are_400s_naming_the_problem(server: Server) -> None:
    def post(**fields: object) -> requests.Response:
        body = {"messages": MESSAGES, "max_tokens": 4, **fields}
        return requests.post(f"{server.url}/v1/chat/completions", json=body, timeout=60)

    unknown = post(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}})
    assert unknown.status_code == 400 and "nope" in unknown.json()["error"]["message"], unknown.text
    assert unknown.json()["error"]["param"] == "tool_choice"
    bad_schema = {"type": "function", "function": {"name": "f", "parameters": {"type": "no-such-type"}}}
    invalid = post(tools=[bad_schema])
    assert invalid.status_code == 400 and invalid.json()["error"]["param"] == "tools", invalid.text
    both = post(tools=TOOLS, tool_choice="required", response_format={"type": "json_object"})
    assert both.status_code == 422 and "response_format" in both.text, both.text


def test_a_pathological_schema_is_a_quick_400(server: Server, client: openai.OpenAI) -> None:
    """Thousands of alternatives of many properties (as a `response_format`: as a tool's `parameters` it
    would first overflow the prompt): llguidance's size limit refuses it in well under a second, and the
    server answers the next request."""
    alternatives = [
        {"type": "object", "properties": {f"p{i}_{j}": {"type": "integer"} for j in range(20)}}
        for i in range(2000)
    ]
    response_format = {
        "type": "json_schema",
        "json_schema": {"name": "huge", "schema": {"anyOf": alternatives}},
    }
    started = time.monotonic()
    refused = requests.post(
        f"{server.url}/v1/chat/completions",
        json={"messages": MESSAGES, "max_tokens": 4, "response_format": response_format},
        timeout=60,
    )
    assert time.monotonic() - started < 5
    assert refused.status_code == 400, refused.text
    error = refused.json()["error"]
    assert error["param"] == "response_format" and "too large" in error["message"], error
    answer = client.chat.completions.create(
        model="SmolLM2-135M-Instruct", messages=MESSAGES, tools=TOOLS, max_tokens=8, temperature=0
    )
    assert answer.choices[0].finish_reason in ("stop", "length", "tool_calls")


@pytest.fixture(scope="module")
def reasoning_server(default_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    server = start_server(
        default_model, tmp_path_factory.mktemp("reasoning"), "--reasoning-parser", "deepseek_r1"
    )
    yield server
    stop_server(server)


def test_reasoning_goes_to_reasoning_content_streamed_or_not(reasoning_server: Server) -> None:
    """DeepSeek-R1's convention: the answer starts inside the thinking, which ends at `</think>`. The 135M
    model never writes one, so every word is reasoning; under a grammar it is free to think first (the
    grammar holds after `</think>`), so it is not forced into JSON."""
    client = openai.OpenAI(base_url=f"{reasoning_server.url}/v1", api_key="unused", max_retries=0)
    fields = dict(model="SmolLM2-135M-Instruct", messages=MESSAGES, max_tokens=24, temperature=0)
    whole = client.chat.completions.create(**fields).choices[0]
    reasoning = whole.message.model_extra["reasoning_content"]
    assert reasoning and not whole.message.content, whole
    streamed = ""
    for chunk in client.chat.completions.create(**fields, stream=True):
        for choice in chunk.choices:
            assert not choice.delta.content, chunk
            streamed += (choice.delta.model_extra or {}).get("reasoning_content") or ""
    assert streamed == reasoning
    constrained = client.chat.completions.create(**fields, response_format={"type": "json_object"}).choices[0]
    # The same tokens while the thinking lasts (only EOS is held back until the grammar is done).
    assert constrained.message.model_extra["reasoning_content"].startswith(reasoning)


MISTRAL_TEMPLATE = (
    "{%- if tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' %}[INST]{{ message.content }}[/INST]"
    "{%- elif message.role == 'tool' %}[TOOL_RESULTS]{{ message.content }}[/TOOL_RESULTS]"
    "{%- elif message.tool_calls %}{%- for call in message.tool_calls %}"
    "[TOOL_CALLS]{{ call.function.name }}[ARGS]{{ call.function.arguments | tojson }}{%- endfor %}</s>"
    "{%- else %}{{ message.content }}</s>{%- endif %}{%- endfor %}"
)


@pytest.fixture(scope="module")
def mistral_model(default_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random model whose tokenizer has Mistral's `[TOOL_CALLS]` and `[ARGS]` as special tokens (two
    of the default tokenizer's special tokens renamed) and whose template writes calls the v11 way."""
    from .conftest import make_tiny_model

    model_dir = make_tiny_model(default_model, tmp_path_factory.mktemp("mistral-tools"))
    renamed = {"<reponame>": "[TOOL_CALLS]", "<file_sep>": "[ARGS]"}
    tokenizer = json.loads((model_dir / "tokenizer.json").read_text())
    for token in tokenizer["added_tokens"]:
        if token["content"] in renamed:
            assert token["special"], token
            token["content"] = renamed[token["content"]]
    vocab = tokenizer["model"]["vocab"]
    for old, new in renamed.items():
        vocab[new] = vocab.pop(old)
    (model_dir / "tokenizer.json").write_text(json.dumps(tokenizer))
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    for token in config.get("added_tokens_decoder", {}).values():
        token["content"] = renamed.get(token["content"], token["content"])
    config["chat_template"] = MISTRAL_TEMPLATE
    (model_dir / "tokenizer_config.json").write_text(json.dumps(config))
    return model_dir


@pytest.fixture(scope="module")
def mistral_server(mistral_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    server = start_server(mistral_model, tmp_path_factory.mktemp("mistral-server"))
    yield server
    stop_server(server)


def test_calls_written_with_special_token_markers_are_read(mistral_server: Server) -> None:
    """The markers are special tokens, which answers leave out by default (`skip_special_tokens`): they stay
    in the text of a request with tools, so forced calls are read back as calls (streamed or not, through
    the chat and the Anthropic APIs), and none of the markers' text reaches the content."""
    import anthropic

    assert "MistralArgs" in mistral_server.log_path.read_text(), "the template's format was not detected"
    client = openai.OpenAI(base_url=f"{mistral_server.url}/v1", api_key="unused", max_retries=0)
    model = client.models.list().data[0].id
    fields = dict(model=model, messages=MESSAGES, tools=TOOLS, tool_choice="required", max_tokens=200, seed=1,
                  temperature=1.0)  # fmt: skip
    whole = client.chat.completions.create(**fields).choices[0]
    assert whole.finish_reason == "tool_calls", whole
    assert whole.message.content is None, whole.message
    check_calls(whole.message.tool_calls, {"get_weather", "get_time"})
    streamed: dict[int, str] = {}
    for chunk in client.chat.completions.create(**fields, stream=True):
        for choice in chunk.choices:
            assert not choice.delta.content, chunk
            for delta in choice.delta.tool_calls or []:
                streamed[delta.index] = streamed.get(delta.index, "") + (delta.function.arguments or "")
    assert list(streamed.values()) == [call.function.arguments for call in whole.message.tool_calls]
    messages = anthropic.Anthropic(base_url=mistral_server.url, api_key="unused", max_retries=0)
    tools = [{"name": t["function"]["name"], "input_schema": t["function"]["parameters"]} for t in TOOLS]
    message = messages.messages.create(
        model=model, max_tokens=200, messages=MESSAGES, tools=tools,
        tool_choice={"type": "tool", "name": "get_time"},
        extra_body={"temperature": 0.0},  # greedy, so repeatable (the API has no seed)
    )  # fmt: skip
    assert message.stop_reason == "tool_use", message
    # Parallel calls are allowed by default (no `disable_parallel_tool_use`): one or more, all get_time.
    assert message.content, message
    for block in message.content:
        assert (block.type, block.name) == ("tool_use", "get_time"), message
        jsonschema.validate(block.input, SCHEMAS["get_time"])


def test_tool_chat_prompts_are_what_transformers_renders(mistral_model: Path, mistral_server: Server) -> None:
    """A tool chat's prompt (tools whose text has non-ASCII characters and HTML's, an assistant's call,
    its result) is exactly the text transformers renders from the same template: `tojson` is Python's
    `json.dumps` (spaced, nothing escaped for HTML), not minijinja's compact one."""
    import transformers

    convert = {
        "type": "function",
        "function": {
            "name": "convert",
            "description": "Währung <EUR> & 'USD' — rate",
            "parameters": {"type": "object", "properties": {"amount": {"type": "number"}}},
        },
    }
    tools = [WEATHER, convert]
    arguments = {"amount": 2.5, "note": "für <you>"}

    def conversation(call_arguments: object) -> list[dict]:
        function = {"name": "convert", "arguments": call_arguments}
        call = {"id": "call_1", "type": "function", "function": function}
        return [
            {"role": "user", "content": "Wie viel sind 2,5 €?"},
            {"role": "assistant", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_1", "content": "2.7"},
        ]

    tokenizer = transformers.AutoTokenizer.from_pretrained(mistral_model)
    # transformers' templates take a call's arguments as a mapping; the OpenAI API sends them as JSON text.
    expected = tokenizer.apply_chat_template(
        conversation(arguments), tools=tools, tokenize=False, add_generation_prompt=True
    )
    assert "Währung <EUR> & 'USD'" in expected and '"amount": 2.5, "note": "für <you>"' in expected
    body = {"messages": conversation(json.dumps(arguments)), "tools": tools}
    rendered = requests.post(f"{mistral_server.url}/tokenize", json=body, timeout=30)
    assert rendered.status_code == 200, rendered.text
    assert rendered.json()["prompt"] == expected
