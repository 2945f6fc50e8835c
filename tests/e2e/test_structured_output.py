"""End to end: constrained decoding with the default 135M model. Seeded sampled requests (temperature 1)
under a non-trivial JSON Schema all return JSON that validates (`jsonschema`), as do a regex, a Lark grammar
and `guided_choice`; the official client's `chat.completions.parse` fills a Pydantic model; a bad schema is a
400 naming the problem; and unconstrained requests batched with constrained ones get exactly the tokens they
get alone."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor
from typing import Literal

import jsonschema
import openai
import pydantic
import pytest
import requests

from .conftest import Server

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "pet": {
            "type": "object",
            "properties": {
                "kind": {"enum": ["cat", "dog", "fish"]},
                "legs": {"type": "integer", "minimum": 0, "maximum": 8},
            },
            "required": ["kind", "legs"],
            "additionalProperties": False,
        },
        "tags": {"type": "array", "items": {"enum": ["red", "blue"]}, "maxItems": 3},
    },
    "required": ["name", "age", "pet", "tags"],
    "additionalProperties": False,
}
MESSAGES = [{"role": "user", "content": "Describe a person and their pet as JSON."}]


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def chat(server: Server, **fields: object) -> dict:
    body = {"messages": MESSAGES, "temperature": 1.0, **fields}
    response = requests.post(f"{server.url}/v1/chat/completions", json=body, timeout=300)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]


def run_all(server: Server, bodies: list[dict]) -> list[dict]:
    with ThreadPoolExecutor(16) as pool:
        return list(pool.map(lambda body: chat(server, **body), bodies))


def test_fifty_sampled_requests_under_a_json_schema_all_validate(server: Server) -> None:
    response_format = {
        "type": "json_schema",
        "json_schema": {"name": "person", "schema": SCHEMA, "strict": True},
    }
    bodies = [{"seed": seed, "max_tokens": 120, "response_format": response_format} for seed in range(50)]
    for choice in run_all(server, bodies):
        assert choice["finish_reason"] == "stop", choice
        jsonschema.validate(json.loads(choice["message"]["content"]), SCHEMA)


def test_regex_grammar_and_choice_constrain_sampled_output(server: Server) -> None:
    pattern = r"[0-9]{3}-[A-Z]{2}( [a-z]{1,4})?"
    lark = 'start: "(" NUM ("+" NUM)* ")"\nNUM: /[1-9]/'
    choices = ["yes", "no", "maybe so"]
    bodies = [{"seed": s, "max_tokens": 20, "guided_regex": pattern} for s in range(10)]
    bodies += [{"seed": s, "max_tokens": 20, "guided_grammar": lark} for s in range(10)]
    bodies += [{"seed": s, "max_tokens": 10, "guided_choice": choices} for s in range(10)]
    results = run_all(server, bodies)
    for choice in results[:10]:
        assert choice["finish_reason"] == "stop" and re.fullmatch(pattern, choice["message"]["content"]), (
            choice
        )
    for choice in results[10:20]:
        text = choice["message"]["content"]
        if choice["finish_reason"] == "stop":
            assert re.fullmatch(r"\([1-9](\+[1-9])*\)", text), choice
        else:  # out of tokens first: a prefix of a sentence, reported as cut off
            assert choice["finish_reason"] == "length" and re.fullmatch(r"\([1-9](\+[1-9]?)*", text), choice
    for choice in results[20:]:
        assert choice["finish_reason"] == "stop" and choice["message"]["content"] in choices, choice


def test_tgi_grammar_on_the_native_api(server: Server) -> None:
    parameters = {
        "max_new_tokens": 12,
        "grammar": {"type": "regex", "value": "[a-c]{2,5}"},
        "do_sample": True,
        "seed": 1,
    }
    response = requests.post(
        f"{server.url}/generate", json={"inputs": "Letters:", "parameters": parameters}, timeout=120
    )
    assert response.status_code == 200, response.text
    assert re.fullmatch("[a-c]{2,5}", response.json()["generated_text"])


class Pet(pydantic.BaseModel):
    kind: Literal["cat", "dog"]
    legs: int


def test_openai_parse_fills_a_pydantic_model(client: openai.OpenAI) -> None:
    completion = client.chat.completions.parse(
        model=client.models.list().data[0].id, messages=MESSAGES, response_format=Pet, max_tokens=40, seed=3
    )
    message = completion.choices[0].message
    assert completion.choices[0].finish_reason == "stop"
    assert isinstance(message.parsed, Pet)


def test_a_bad_schema_is_a_400_naming_the_problem(server: Server) -> None:
    body = {
        "messages": MESSAGES,
        "max_tokens": 5,
        "guided_json": {"type": "object", "properties": {"a": {"type": "nope"}}},
    }
    response = requests.post(f"{server.url}/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "guided_json" and "nope" in error["message"], error


def test_unconstrained_requests_are_unchanged_by_constrained_neighbours(server: Server) -> None:
    unconstrained = [{"seed": 11, "max_tokens": 24}, {"temperature": 0, "max_tokens": 24}]
    alone = [chat(server, **body) for body in unconstrained]
    constrained = {"max_tokens": 40, "guided_json": SCHEMA}
    mixed = run_all(server, [constrained | {"seed": s} for s in range(6)] + unconstrained)
    assert [c["message"]["content"] for c in mixed[6:]] == [c["message"]["content"] for c in alone]
