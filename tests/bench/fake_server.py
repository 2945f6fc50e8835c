"""A tiny OpenAI-compatible and Rill/TGI-native streaming server with known delays, for the bench tests.

It serves `POST /v1/completions` and `POST /v1/chat/completions` (stream, `include_usage`; a chat stream
starts with a role-only chunk, as OpenAI's does), `POST /generate_stream`, and `GET /v1/models`
from an aiohttp app on its own event loop in a thread, so the bench under test runs its own `asyncio.run`.
Each answer waits `ttft_s`, sends its first token, then one token every `itl_s`; it has `max_tokens`
(or `max_new_tokens`) tokens unless `num_tokens` caps it.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web


@dataclass
class FakeBehaviour:
    """How the fake answers; every field may be changed between runs."""

    ttft_s: float = 0.05
    itl_s: float = 0.01
    num_tokens: int | None = None
    num_empty_first_tokens: int = 0
    """Native only: this many token events with empty text come first (text held back), as Rill can send."""
    status_for: Callable[[int], int] = lambda request_number: 200
    """HTTP status for the n-th request (0-based); anything but 200 answers a JSON error at once."""
    stream_error_after: int | None = None
    """Send an error event after this many tokens instead of finishing."""
    is_stream_cut: bool = False
    """End the stream after the tokens without the last event (no [DONE], no details)."""
    model_id: str = "fake-model"
    max_concurrent_requests: int = 4
    """`GET /info`: the capacity the soak multiplies."""
    used_blocks: int = 0
    """`GET /info`: KV blocks still held (a leak when the server is idle)."""


@dataclass
class FakeServer:
    behaviour: FakeBehaviour = field(default_factory=FakeBehaviour)
    bodies: list[dict[str, Any]] = field(default_factory=list)
    paths: list[str] = field(default_factory=list)
    outcomes: dict[str, int] = field(default_factory=dict)
    """Served at /metrics as rill_requests_total{outcome=...}."""
    num_in_flight: int = 0
    max_in_flight: int = 0
    url: str = ""

    def start(self) -> FakeServer:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        app = web.Application()
        app.router.add_post("/v1/completions", self._openai)
        app.router.add_post("/v1/chat/completions", self._openai)
        app.router.add_post("/generate_stream", self._native)
        app.router.add_get("/v1/models", self._models)
        for path in ("/generate", "/tokenize"):  # only malformed bodies reach these
            app.router.add_post(path, self._reject)
        app.router.add_get("/info", self._info)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/health", self._ok)
        app.router.add_get("/ready", self._ok)
        self._runner = web.AppRunner(app)
        asyncio.run_coroutine_threadsafe(self._serve(sock), self._loop).result(timeout=10)
        return self

    async def _serve(self, sock: socket.socket) -> None:
        await self._runner.setup()
        await web.SockSite(self._runner, sock).start()

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(timeout=10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._loop.close()

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response(
            {"object": "list", "data": [{"id": self.behaviour.model_id, "object": "model"}]}
        )

    async def _info(self, request: web.Request) -> web.Response:
        kv = {"used_blocks": self.behaviour.used_blocks, "waiting_requests": 0, "running_requests": 0}
        info = {"max_concurrent_requests": self.behaviour.max_concurrent_requests, "max_total_tokens": 128}
        return web.json_response({**info, "kv": kv})

    async def _metrics(self, request: web.Request) -> web.Response:
        lines = [f'rill_requests_total{{outcome="{k}"}} {v}' for k, v in self.outcomes.items()]
        return web.Response(text="\n".join(lines) + "\n")

    async def _ok(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ready"})

    async def _reject(self, request: web.Request) -> web.Response:
        await request.read()
        return web.json_response({"error": "malformed", "error_type": "validation"}, status=422)

    async def _begin(self, request: web.Request) -> tuple[dict[str, Any], web.StreamResponse | web.Response]:
        try:
            body = await request.json()
            assert isinstance(body, dict) and request.content_type == "application/json"
            if request.path == "/v1/completions":
                assert isinstance(body["prompt"], str) and isinstance(body["max_tokens"], int)
            elif request.path == "/v1/chat/completions":
                assert isinstance(body["max_tokens"], int) and body["messages"]
                for message in body["messages"]:
                    assert message["role"] in ("system", "user", "assistant")
                    assert isinstance(message["content"], str)
            else:
                assert isinstance(body["inputs"], str) and isinstance(
                    body["parameters"]["max_new_tokens"], int
                )
                assert body["parameters"]["max_new_tokens"] > 0
        except (ValueError, AssertionError, KeyError, TypeError):
            error = {"error": "malformed body", "error_type": "validation"}
            return {}, web.json_response(error, status=400)
        number = len(self.bodies)
        self.bodies.append(body)
        self.paths.append(request.path)
        status = self.behaviour.status_for(number)
        if status != 200:
            error = {"error": f"fake status {status}", "error_type": "overloaded"}
            return body, web.json_response(error, status=status, headers={"Retry-After": "1"})
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        return body, response

    async def _stream(
        self,
        response: web.StreamResponse,
        num_tokens: int,
        event: Callable[[int], dict[str, Any]],
        end: Callable[[], list[str]],
    ) -> None:
        self.num_in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.num_in_flight)
        try:
            await asyncio.sleep(self.behaviour.ttft_s)
            for i in range(num_tokens):
                if i:
                    await asyncio.sleep(self.behaviour.itl_s)
                if self.behaviour.stream_error_after == i:
                    error = {"error": "fake failure", "error_type": "generation"}
                    await response.write(f"event: error\ndata: {json.dumps(error)}\n\n".encode())
                    return
                await response.write(f"data: {json.dumps(event(i))}\n\n".encode())
            if not self.behaviour.is_stream_cut:
                for line in end():
                    await response.write(f"data: {line}\n\n".encode())
        finally:
            self.num_in_flight -= 1

    async def _openai(self, request: web.Request) -> web.StreamResponse | web.Response:
        body, response = await self._begin(request)
        if isinstance(response, web.Response):  # an error status, answered at once
            return response
        num_tokens = min(body["max_tokens"], self.behaviour.num_tokens or body["max_tokens"])
        is_chat = request.path == "/v1/chat/completions"
        prompt = " ".join(message["content"] for message in body["messages"]) if is_chat else body["prompt"]
        if is_chat:
            role = {"index": 0, "delta": {"role": "assistant"}, "finish_reason": None}
            await response.write(f"data: {json.dumps({'id': 'chat-1', 'choices': [role]})}\n\n".encode())

        def event(i: int) -> dict[str, Any]:
            finish = "length" if i == num_tokens - 1 else None
            if is_chat:
                delta = {
                    "index": 0,
                    "delta": {"content": f" t{i}"},
                    "logprobs": None,
                    "finish_reason": finish,
                }
                return {"id": "chat-1", "object": "chat.completion.chunk", "model": body["model"],
                        "choices": [delta]}  # fmt: skip
            choice = {"index": 0, "text": f" t{i}", "logprobs": None, "finish_reason": finish}
            return {"id": "cmpl-1", "object": "text_completion", "model": body["model"], "choices": [choice]}

        def end() -> list[str]:
            lines = []
            if (body.get("stream_options") or {}).get("include_usage"):
                usage = {"prompt_tokens": len(prompt.split()), "completion_tokens": num_tokens}
                lines.append(json.dumps({"id": "cmpl-1", "choices": [], "usage": usage}))
            return [*lines, "[DONE]"]

        await self._stream(response, num_tokens, event, end)
        return response

    async def _native(self, request: web.Request) -> web.StreamResponse | web.Response:
        body, response = await self._begin(request)
        if isinstance(response, web.Response):  # an error status, answered at once
            return response
        max_new_tokens = body["parameters"]["max_new_tokens"]
        num_tokens = min(max_new_tokens, self.behaviour.num_tokens or max_new_tokens)
        empty = self.behaviour.num_empty_first_tokens

        def event(i: int) -> dict[str, Any]:
            text = "" if i < empty else (" t0" * (empty + 1) if i == empty else f" t{i}")
            token = {"id": 100 + i, "text": text, "logprob": -0.5, "special": False}
            payload: dict[str, Any] = {"index": i, "token": token, "generated_text": None, "details": None}
            if i == num_tokens - 1 and not self.behaviour.is_stream_cut:
                payload["generated_text"] = "".join(f" t{j}" for j in range(num_tokens))
                payload["details"] = {
                    "finish_reason": "length",
                    "generated_tokens": num_tokens,
                    "seed": None,
                    "input_length": len(body["inputs"].split()),
                }
            return payload

        await self._stream(response, num_tokens, event, list)
        return response
