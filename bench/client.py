"""One streamed request, timed: the two API flavours and the SSE reader they share.

Timing rules (the same for both flavours):
- a *token event* is a native `data:` event with a `token`, or an OpenAI chunk whose `choices[0].text` (chat:
  `choices[0].delta.content`) is not empty (an OpenAI chunk may carry several tokens; it is still one event);
- TTFT is the time from sending the request to the first token event whose text is not empty;
- ITL is every gap between consecutive token events from that first one on;
- e2e is the time from sending to the end of the stream (`data: [DONE]`, or the native event with `details`);
- output tokens are the server's count when it gives one (`usage.completion_tokens`,
  `details.generated_tokens`), else the number of token events.

A request fails with an `error_kind`: the HTTP status as text (`"429"`, `"422"`, ...) for a non-200 answer,
`"stream"` for an error event or a stream that ends before its last event, `"timeout"`, or `"connection"`.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from typing import Any

import aiohttp

from bench.workloads import RequestSpec

API_FLAVOURS = ("openai", "chat", "native")


@dataclass
class RequestRecord:
    """What happened to one request; times are in seconds."""

    index: int
    session: int
    turn: int
    prompt_tokens: int
    max_tokens: int
    start_s: float = 0.0
    """When it was sent, from the start of the run."""
    is_ok: bool = False
    status: int | None = None
    """HTTP status, None when no answer came."""
    error_kind: str | None = None
    error: str | None = None
    ttft_s: float | None = None
    e2e_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    output_tokens: int = 0
    server_prompt_tokens: int | None = None
    """The prompt length the server reports (`usage.prompt_tokens`, `details.input_length`), if it does."""


@dataclass
class StreamEvent:
    """What one SSE `data:` event means, whatever the API flavour."""

    is_token: bool = False
    text: str = ""
    is_last: bool = False
    num_output_tokens: int | None = None
    """The server's own count of output tokens, when this event carries it."""
    num_prompt_tokens: int | None = None
    error: str | None = None


@dataclass(frozen=True)
class Target:
    """A server to load and how to talk to it."""

    url: str
    """Base URL, e.g. http://127.0.0.1:8080 (no path)."""
    api: str = "native"
    label: str = ""
    model: str | None = None
    """OpenAI `model` field; None asks `GET /v1/models` for the first one. Comma-separated names are sent in
    turn (`model_for`)."""
    temperature: float = 0.0
    ignore_eos: bool = False
    """Send vLLM's `ignore_eos: true` (OpenAI flavours only) so outputs run to `max_tokens`."""

    @property
    def name(self) -> str:
        return self.label or self.url

    def model_for(self, index: int) -> str:
        """The `model` of the workload's request `index`: the names of `model` in turn."""
        names = (self.model or "default").split(",")
        return names[index % len(names)]


class OpenAIApi:
    """`POST /v1/completions` with `stream: true` and `stream_options.include_usage`."""

    path = "/v1/completions"

    def __init__(self, target: Target) -> None:
        self.target = target

    def body(self, spec: RequestSpec) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": self.target.model_for(spec.index),
            "prompt": spec.prompt,
            "max_tokens": spec.max_tokens,
            "temperature": self.target.temperature,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if self.target.ignore_eos:
            body["ignore_eos"] = True
        return body

    def parse(self, event_name: str, data: str) -> StreamEvent:
        if data == "[DONE]":
            return StreamEvent(is_last=True)
        payload = json.loads(data)
        if event_name == "error" or "error" in payload:
            return StreamEvent(error=str(payload.get("error", payload))[:200])
        event = StreamEvent()
        choices = payload.get("choices") or []
        if choices:
            event.text = self.text(choices[0])
            event.is_token = bool(event.text)
        usage = payload.get("usage")
        if usage and usage.get("completion_tokens") is not None:
            event.num_output_tokens = int(usage["completion_tokens"])
        if usage and usage.get("prompt_tokens") is not None:
            event.num_prompt_tokens = int(usage["prompt_tokens"])
        return event

    def text(self, choice: dict[str, Any]) -> str:
        return str(choice.get("text") or "")


class ChatApi(OpenAIApi):
    """`POST /v1/chat/completions`, the prompt as one user message: the server applies the model's chat
    template, which instruction-tuned models need to follow an instruction (the `repeat` workload's)."""

    path = "/v1/chat/completions"

    def body(self, spec: RequestSpec) -> dict[str, Any]:
        body = super().body(spec)
        body["messages"] = [{"role": "user", "content": body.pop("prompt")}]
        return body

    def text(self, choice: dict[str, Any]) -> str:
        return str((choice.get("delta") or {}).get("content") or "")


class NativeApi:
    """Rill/TGI `POST /generate_stream`: one event per token, the last with `generated_text` and `details`."""

    path = "/generate_stream"

    def __init__(self, target: Target) -> None:
        self.target = target

    def body(self, spec: RequestSpec) -> dict[str, Any]:
        parameters: dict[str, Any] = {"max_new_tokens": spec.max_tokens}
        if self.target.temperature > 0:
            parameters.update(do_sample=True, temperature=self.target.temperature)
        return {"inputs": spec.prompt, "parameters": parameters}

    def parse(self, event_name: str, data: str) -> StreamEvent:
        payload = json.loads(data)
        if event_name == "error" or "error" in payload:
            return StreamEvent(error=str(payload.get("error", payload))[:200])
        event = StreamEvent()
        token = payload.get("token")
        if token is not None:
            event.is_token = True
            event.text = token.get("text") or ""
        details = payload.get("details")
        if details is not None or payload.get("generated_text") is not None:
            event.is_last = True
            if details and details.get("generated_tokens") is not None:
                event.num_output_tokens = int(details["generated_tokens"])
            if details and details.get("input_length") is not None:
                event.num_prompt_tokens = int(details["input_length"])
        return event


def make_api(target: Target) -> OpenAIApi | NativeApi:
    if target.api == "openai":
        return OpenAIApi(target)
    if target.api == "chat":
        return ChatApi(target)
    if target.api == "native":
        return NativeApi(target)
    raise ValueError(f"unknown API flavour {target.api!r}; choose one of {', '.join(API_FLAVOURS)}")


async def sse_events(response: aiohttp.ClientResponse) -> AsyncIterator[tuple[str, str]]:
    """(event name, data) for each `data:` line, as soon as its line arrives; lines may be of any length."""
    buffer = b""
    event_name = "message"
    async for chunk in response.content.iter_any():
        buffer += chunk
        *lines, buffer = buffer.split(b"\n")
        for raw in lines:
            line = raw.decode("utf-8").rstrip("\r")
            if not line:
                event_name = "message"
            elif line.startswith("event:"):
                event_name = line[len("event:") :].strip()
            elif line.startswith("data:"):
                yield event_name, line[len("data:") :].strip()


async def resolve_model(session: aiohttp.ClientSession, target: Target) -> Target:
    """The target with `model` filled from `GET /v1/models` when an OpenAI flavour needs one."""
    if target.api == "native" or target.model is not None:
        return target
    try:
        async with session.get(target.url.rstrip("/") + "/v1/models") as response:
            if response.status == 200:
                models = (await response.json()).get("data") or []
                if models:
                    return replace(target, model=str(models[0]["id"]))
    except (aiohttp.ClientError, ValueError, KeyError):
        pass  # the server has no model list; "default" is sent, and --model overrides it
    return replace(target, model="default")


async def send_request(
    session: aiohttp.ClientSession, api: OpenAIApi | NativeApi, spec: RequestSpec, run_start: float
) -> RequestRecord:
    """Send `spec`, stream the answer, and time it. Never raises for a server or network failure."""
    record = RequestRecord(spec.index, spec.session, spec.turn, spec.prompt_tokens, spec.max_tokens)
    start = time.perf_counter()
    record.start_s = start - run_start
    try:
        async with session.post(api.target.url.rstrip("/") + api.path, json=api.body(spec)) as response:
            record.status = response.status
            if response.status != 200:
                record.error_kind = str(response.status)
                record.error = (await response.text())[:200]
                return record
            await _read_stream(response, api, record, start)
    except asyncio.TimeoutError:
        record.error_kind, record.error = "timeout", "no answer within --timeout"
    except aiohttp.ClientError as error:
        record.error_kind, record.error = "connection", f"{type(error).__name__}: {error}"[:200]
    except (ValueError, KeyError, TypeError) as error:
        record.error_kind, record.error = "stream", f"unreadable event: {error}"[:200]
    return record


async def _read_stream(
    response: aiohttp.ClientResponse, api: OpenAIApi | NativeApi, record: RequestRecord, start: float
) -> None:
    token_times: list[float] = []
    num_output_tokens: int | None = None
    async for event_name, data in sse_events(response):
        now = time.perf_counter()
        event = api.parse(event_name, data)
        if event.error is not None:
            record.error_kind, record.error = "stream", event.error
            return
        if event.is_token and (token_times or event.text):
            if not token_times:
                record.ttft_s = now - start
            token_times.append(now)
        if event.num_output_tokens is not None:
            num_output_tokens = event.num_output_tokens
        if event.num_prompt_tokens is not None:
            record.server_prompt_tokens = event.num_prompt_tokens
        if event.is_last:
            record.e2e_s = now - start
            break
    if record.e2e_s is None:
        record.error_kind, record.error = "stream", "the stream ended before its last event"
        return
    record.itl_s = [later - earlier for earlier, later in itertools.pairwise(token_times)]
    record.output_tokens = num_output_tokens if num_output_tokens is not None else len(token_times)
    record.is_ok = True
