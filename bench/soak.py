"""`python -m bench soak`: a robustness soak — load beyond capacity, clients that vanish, malformed requests.

It reads the server's capacity (`max_concurrent_requests` from `GET /info`) and keeps `--capacity-multiple`
times that many requests in flight (closed loop) until `--num-requests` are sent or `--duration` has
passed. Each request is, by a seeded draw:
- **malformed** (`--malformed-share`): a body that is not JSON, not UTF-8, of the wrong shape, with fields of
  the wrong type or out of range, or of the wrong content type, to one of the generation/tokenize routes;
  the server must answer a 4xx;
- **disconnecting** (`--disconnect-share`): a normal streaming request that the client drops after a seeded
  random delay in [0, `--disconnect-max-s`] (before the answer's first byte, or mid-stream); the server must
  cancel it and free its KV blocks;
- **slow reader** (`--slow-reader-share`): a long streaming request from a socket with a small receive
  buffer that reads nothing for `--slow-reader-hold-s`, then reads what is left: the server should have cut
  it off (`--max-unread-tokens`; an SSE `error` event naming it) without slowing anyone else;
- **deadline** (`--deadline-share`): a long request with a `timeout` of `--deadline-s` seconds, streaming or
  not (a seeded draw): it must end with a 504 or an SSE `error` event naming the deadline (or finish first);
- **idle connection** (`--idle-connection-share`): a connection that sends nothing, held until the server
  closes it (`--header-read-timeout`) or `--idle-connection-max-s` passes;
- **normal**: a streaming `POST /generate_stream` (or `/v1/completions` with `--api openai`) with a short
  random prompt and `--max-tokens` output tokens, read to its end with the bench's own client.

Then it waits for the server to go idle and reports: outcomes by class (ok, each 4xx status, 429, 503,
other 5xx, stream errors, timeouts, connection errors, disconnected by us, slow readers cut off, deadlines,
idle connections), KV blocks still held (`kv.used_blocks` of `/info`: a leak), `/health` and `/ready`, and
the server's `rill_requests_total` and `rill_slow_readers_total` deltas against the faults it made. It exits 1
on any 5xx other than the documented ones (503; 504 for a deadline), any stream or connection error or
timeout, a leaked block, or an unhealthy server afterwards.
"""

from __future__ import annotations

import asyncio
import json
import random
import re
import socket
import time
from collections import Counter
from dataclasses import asdict, dataclass, field, replace
from typing import Any
from urllib.parse import urlsplit

import aiohttp

from bench.client import Target, make_api, resolve_model, send_request, sse_events
from bench.workloads import RequestSpec, TextSource

FAILURE_CLASSES = ("5xx", "4xx-not-json", "stream-error", "timeout", "connection")
RETRY_AFTER_CAP_S = 0.5
"""After a 429 a worker waits a random 50-100% of this before its next request (as a client honouring a
short Retry-After would), so the soak offers load at the multiple of capacity instead of spinning on 429s."""
MALFORMED_ROUTES = ("/generate", "/generate_stream", "/v1/completions", "/v1/chat/completions", "/tokenize")


@dataclass(frozen=True)
class SoakConfig:
    num_requests: int = 5000
    capacity_multiple: float = 2.0
    disconnect_share: float = 0.1
    malformed_share: float = 0.05
    duration_s: float | None = None
    """No request starts after this; in-flight ones finish."""
    max_tokens: int = 16
    prompt_words: tuple[int, int] = (4, 24)
    disconnect_max_s: float = 0.5
    slow_reader_share: float = 0.0
    slow_reader_hold_s: float = 10.0
    deadline_share: float = 0.0
    deadline_s: float = 0.2
    idle_connection_share: float = 0.0
    idle_connection_max_s: float = 15.0
    timeout_s: float = 120.0
    idle_timeout_s: float = 120.0
    seed: int = 0

    @property
    def shares(self) -> tuple[float, ...]:
        """The shares of the fault kinds, in the order `_Soak.one` draws them."""
        return (
            self.malformed_share,
            self.disconnect_share,
            self.slow_reader_share,
            self.deadline_share,
            self.idle_connection_share,
        )

    def __post_init__(self) -> None:
        if not all(0 <= share <= 1 for share in self.shares) or sum(self.shares) > 1:
            raise ValueError("the --*-share flags must be in [0, 1], and add up to at most 1")
        if self.deadline_s <= 0:
            raise ValueError("--deadline-s must be > 0")
        if self.capacity_multiple <= 0 or self.num_requests < 1:
            raise ValueError("--capacity-multiple must be > 0 and --num-requests >= 1")


@dataclass
class SoakResult:
    capacity: int
    concurrency: int
    num_sent: int
    duration_s: float
    outcomes: dict[str, int]
    """Class of every request: ok, 4xx codes ("400", "422", ...), "429", "503", "5xx", "stream-error",
    "timeout", "connection", "disconnected" (dropped by us before its end), "malformed-accepted"."""
    num_disconnects_sent: int
    """Requests drawn to disconnect (some end before their drop time and count as ok)."""
    num_disconnected: int
    """Requests we really dropped before their stream ended."""
    cancelled_delta: int | None
    """Change of rill_requests_total{outcome="cancelled"}; None when /metrics has no such counter."""
    slow_readers_delta: int | None
    """Change of rill_slow_readers_total; None when /metrics has no such counter."""
    server_outcomes_delta: dict[str, int]
    leaked_kv_blocks: int | None
    """`kv.used_blocks` once idle; None when the server never went idle or has no /info."""
    kv_after: dict[str, Any] | None
    health_status: int | None
    ready_status: int | None
    failure_examples: list[str] = field(default_factory=list)

    @property
    def num_failures(self) -> int:
        return sum(self.outcomes.get(kind, 0) for kind in FAILURE_CLASSES)

    @property
    def is_ok(self) -> bool:
        return (
            self.num_failures == 0
            and self.leaked_kv_blocks == 0
            and self.health_status == 200
            and self.ready_status == 200
        )


def malformed_request(rng: random.Random) -> tuple[str, bytes, str]:
    """(route, body, content type) of one seeded malformed request."""
    route = rng.choice(MALFORMED_ROUTES)
    good = {"inputs": "hi", "parameters": {"max_new_tokens": 4}}
    kinds = [
        (b'{"inputs": "hi", "parameters": {', "application/json"),
        (b"\xff\xfe{not json", "application/json"),
        (b'{"inputs": "\xc3\x28 \xed\xa0\x80"}', "application/json"),
        (b"", "application/json"),
        (b"[1, 2, 3]", "application/json"),
        (b'{"inputs": NaN, "prompt": Infinity}', "application/json"),
        (json.dumps(good).encode(), "text/plain"),
        (json.dumps({"inputs": 42, "prompt": {"a": []}, "messages": "x"}).encode(), "application/json"),
        (json.dumps({**good, "parameters": {"max_new_tokens": -3}}).encode(), "application/json"),
        (json.dumps({**good, "parameters": {"temperature": "hot", "top_p": 7}}).encode(), "application/json"),
        (json.dumps({"prompt": "hi", "max_tokens": 2**40, "n": 0}).encode(), "application/json"),
        (json.dumps({"inputs": "word " * 5000, "prompt": "word " * 5000}).encode(), "application/json"),
        (json.dumps({"messages": [{"role": "wizard", "content": 3}], "unknown_field": True}).encode(),
         "application/json"),
    ]  # fmt: skip
    body, content_type = rng.choice(kinds)
    if route == "/tokenize" and b"word word" in body:
        route = "/generate"  # /tokenize has no prompt length limit: a long prompt is not malformed there
    return route, body, content_type


def _status_class(status: int) -> str:
    if status == 200:
        return "ok"
    # 503: overloaded or shutting down; 504: a request's deadline passed. Both are documented answers.
    if status in (429, 503, 504) or 400 <= status < 500:
        return str(status)
    return "5xx" if status >= 500 else f"http-{status}"


class _Soak:
    def __init__(
        self,
        http: aiohttp.ClientSession,
        target: Target,
        config: SoakConfig,
        start: float,
        info: dict[str, Any],
    ) -> None:
        self.http, self.target, self.config, self.start = http, target, config, start
        # Dropped requests get connections of their own, never reused: a request cancelled while its
        # connection is being set up must not hand a half-read connection to a later request.
        self.drop_http = aiohttp.ClientSession(
            timeout=http.timeout, connector=aiohttp.TCPConnector(limit=0, force_close=True)
        )
        # Dropped requests (and deadlines) ask for as many tokens as fit (up to 256), so the drop comes before
        # their end; slow readers for up to 1,000, to outlast the socket buffers and --max-unread-tokens.
        max_prompt_tokens = 2 * config.prompt_words[1] + 8
        room = int(info.get("max_total_tokens", 0)) - max_prompt_tokens
        self.disconnect_max_tokens = max(config.max_tokens, min(256, room))
        self.slow_reader_max_tokens = max(config.max_tokens, min(1000, room))
        self.api = make_api(target)
        self.text = TextSource()
        self.outcomes: Counter[str] = Counter()
        self.num_disconnects_sent = 0
        self.failure_examples: list[str] = []

    def _spec(self, index: int, rng: random.Random) -> RequestSpec:
        num_words = rng.randint(*self.config.prompt_words)
        return RequestSpec(
            index, index, 0, self.text.words(rng, num_words), num_words, self.config.max_tokens
        )

    def _note(self, kind: str, detail: str) -> None:
        self.outcomes[kind] += 1
        if kind in FAILURE_CLASSES and len(self.failure_examples) < 10:
            self.failure_examples.append(f"{kind}: {detail}"[:300])

    async def normal(self, index: int, rng: random.Random) -> None:
        record = await send_request(self.http, self.api, self._spec(index, rng), self.start)
        if record.status == 429:
            self._note("429", "")
            await asyncio.sleep(rng.uniform(0.5, 1.0) * RETRY_AFTER_CAP_S)  # a polite client backs off
        elif record.is_ok:
            self._note("ok", "")
        elif record.error_kind in ("stream", "timeout", "connection"):
            kind = {"stream": "stream-error"}.get(record.error_kind, record.error_kind)
            self._note(kind, record.error or "")
        else:
            self._note(_status_class(record.status or 0), record.error or "")

    async def disconnecting(self, index: int, rng: random.Random) -> None:
        self.num_disconnects_sent += 1
        spec = replace(self._spec(index, rng), max_tokens=self.disconnect_max_tokens)
        delay_s = rng.uniform(0.0, self.config.disconnect_max_s)
        response: aiohttp.ClientResponse | None = None

        async def go() -> str:
            nonlocal response
            url = self.target.url.rstrip("/") + self.api.path
            response = await self.drop_http.post(url, json=self.api.body(spec))
            if response.status != 200:
                return _status_class(response.status)
            async for event_name, data in sse_events(response):
                event = self.api.parse(event_name, data)
                if event.error is not None:
                    return "stream-error"
                if event.is_last:
                    return "ok"
            return "stream-error"

        try:
            kind = await asyncio.wait_for(go(), delay_s)
            self._note(kind, f"disconnecting request {index} ended as {kind}")
            if kind == "429":
                await asyncio.sleep(rng.uniform(0.5, 1.0) * RETRY_AFTER_CAP_S)
        except asyncio.TimeoutError:
            self._note("disconnected", "")
        except aiohttp.ClientError as error:
            self._note("connection", f"{type(error).__name__}: {error}")
        finally:
            if response is not None:
                response.close()  # drops the connection: the server sees the client go

    async def slow_reader(self, index: int, rng: random.Random) -> None:
        """Sends a long stream from a socket with a small receive buffer, reads nothing for a while, then
        reads the rest: it should end with the server's `--max-unread-tokens` error event."""
        spec = replace(self._spec(index, rng), max_tokens=self.slow_reader_max_tokens)
        payload = json.dumps(self.api.body(spec)).encode()
        host, port = _host_port(self.target.url)
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.setblocking(False)
        writer = None
        try:
            await asyncio.get_running_loop().sock_connect(sock, (host, port))
            # A small stream buffer too: asyncio stops reading the socket once 2 KiB wait unread.
            reader, writer = await asyncio.open_connection(sock=sock, limit=1024)
            head = (
                f"POST {self.api.path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(payload)}\r\nConnection: close\r\n\r\n"
            )
            writer.write(head.encode() + payload)
            await writer.drain()
            await asyncio.sleep(self.config.slow_reader_hold_s)
            answer = b""
            while chunk := await asyncio.wait_for(reader.read(1 << 16), self.config.timeout_s):
                answer += chunk
            status = int(answer.split(b" ", 2)[1]) if answer.startswith(b"HTTP/1.1 ") else 0
            if status != 200:
                self._note(_status_class(status), f"slow reader {index}: {answer[:200]!r}")
            elif b"--max-unread-tokens" in answer:
                self._note("slow-reader-cut", "")
            elif re.search(rb'"details": ?\{', answer) or b"data: [DONE]" in answer:
                self._note("ok", "")  # it ended before the server had to cut it off
            else:
                self._note("stream-error", f"slow reader {index}: {answer[-200:]!r}")
        except asyncio.TimeoutError:
            self._note("timeout", f"slow reader {index}")
        except OSError as error:
            self._note("connection", f"slow reader {index}: {type(error).__name__}: {error}")
        finally:
            if writer is not None:
                writer.close()
            else:
                sock.close()

    async def deadline(self, index: int, rng: random.Random) -> None:
        """A long request with a short `timeout`, streaming or not: a 504, or an SSE `error` event naming
        the deadline (or its output, should it finish first)."""
        spec = replace(self._spec(index, rng), max_tokens=self.disconnect_max_tokens)
        body = self.api.body(spec)
        is_stream = rng.random() < 0.5
        path = self.api.path
        if self.target.api == "native":
            body["parameters"]["timeout"] = self.config.deadline_s
            path = path if is_stream else "/generate"
        else:
            body["timeout"] = self.config.deadline_s
            body["stream"] = is_stream
            if not is_stream:
                del body["stream_options"]
        try:
            async with self.http.post(self.target.url.rstrip("/") + path, json=body) as response:
                if response.status != 200 or not is_stream:
                    await response.read()
                    self._note(_status_class(response.status), f"deadline request {index}: {response.status}")
                    return
                async for event_name, data in sse_events(response):
                    event = self.api.parse(event_name, data)
                    if event.error is not None:
                        self._note("deadline" if "deadline" in event.error else "stream-error", event.error)
                        return
                    if event.is_last:
                        self._note("ok", "")
                        return
                self._note("stream-error", f"deadline request {index}: the stream ended early")
        except asyncio.TimeoutError:
            self._note("timeout", f"deadline request {index}")
        except aiohttp.ClientError as error:
            self._note("connection", f"{type(error).__name__}: {error}")

    async def idle_connection(self) -> None:
        """Connects and sends nothing, until the server closes the connection or the hold time passes."""
        host, port = _host_port(self.target.url)
        try:
            reader, writer = await asyncio.open_connection(host, port)
        except OSError as error:
            self._note("connection", f"idle connection: {type(error).__name__}: {error}")
            return
        try:
            await asyncio.wait_for(reader.read(), self.config.idle_connection_max_s)
            self._note("idle-closed", "")
        except asyncio.TimeoutError:
            self._note("idle-open", "")
        except OSError:
            self._note("idle-closed", "")  # reset by the server
        finally:
            writer.close()

    async def malformed(self, rng: random.Random) -> None:
        route, body, content_type = malformed_request(rng)
        url = self.target.url.rstrip("/") + route
        try:
            async with self.http.post(url, data=body, headers={"Content-Type": content_type}) as response:
                payload = await response.read()
                if response.status == 200:
                    self._note("malformed-accepted", f"{route} {body[:80]!r}")
                    return
                kind = _status_class(response.status)
                if 400 <= response.status < 500 and not _is_json(payload):
                    kind = "4xx-not-json"
                self._note(kind, f"{route} {body[:80]!r} -> {response.status} {payload[:200]!r}")
        except asyncio.TimeoutError:
            self._note("timeout", f"malformed {route}")
        except aiohttp.ClientError as error:
            self._note("connection", f"{type(error).__name__}: {error}")

    async def one(self, index: int) -> None:
        rng = random.Random(self.config.seed * 1_000_003 + index)
        draw = rng.random()
        kinds = (
            lambda: self.malformed(rng),
            lambda: self.disconnecting(index, rng),
            lambda: self.slow_reader(index, rng),
            lambda: self.deadline(index, rng),
            self.idle_connection,
        )
        bound = 0.0
        for share, kind in zip(self.config.shares, kinds, strict=True):
            bound += share
            if draw < bound:
                await kind()
                return
        await self.normal(index, rng)


def _host_port(url: str) -> tuple[str, int]:
    parts = urlsplit(url)
    return parts.hostname or "127.0.0.1", parts.port or 80


def _is_json(payload: bytes) -> bool:
    try:
        json.loads(payload)
    except ValueError:
        return False
    return True


async def _get(http: aiohttp.ClientSession, url: str) -> tuple[int | None, str]:
    try:
        async with http.get(url, timeout=aiohttp.ClientTimeout(total=10)) as response:
            return response.status, await response.text()
    except (aiohttp.ClientError, asyncio.TimeoutError) as error:
        return None, str(error)


def _server_outcomes(metrics_text: str) -> Counter[str]:
    """`rill_requests_total` by outcome, and `rill_slow_readers_total` as "slow_readers"."""
    found = re.findall(r'^rill_requests_total\{outcome="(\w+)"\} (\S+)$', metrics_text, re.MULTILINE)
    found += re.findall(r"^rill_(slow_readers)_total (\S+)$", metrics_text, re.MULTILINE)
    return Counter({outcome: int(float(value)) for outcome, value in found})


async def _wait_idle(http: aiohttp.ClientSession, url: str, timeout_s: float) -> dict[str, Any] | None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        status, text = await _get(http, url + "/info")
        if status == 200:
            kv = json.loads(text)["kv"]
            if kv.get("waiting_requests", 0) == 0 and kv.get("running_requests", 0) == 0:
                return kv
        await asyncio.sleep(0.2)
    return None


async def run_soak(target: Target, config: SoakConfig, is_progress_shown: bool = True) -> SoakResult:
    from tqdm import tqdm

    url = target.url.rstrip("/")
    timeout = aiohttp.ClientTimeout(total=config.timeout_s)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as http:
        status, text = await _get(http, url + "/info")
        if status != 200:
            raise ValueError(f"GET {url}/info answered {status}: {text[:200]}")
        info = json.loads(text)
        capacity = int(info["max_concurrent_requests"])
        target = await resolve_model(http, target)
        concurrency = max(1, round(capacity * config.capacity_multiple))
        metrics_before = _server_outcomes((await _get(http, url + "/metrics"))[1])
        start = time.perf_counter()
        deadline = start + config.duration_s if config.duration_s is not None else float("inf")
        soak = _Soak(http, target, config, start, info)
        indices = iter(range(config.num_requests))
        num_sent = 0
        with tqdm(total=config.num_requests, desc="soak", unit="req", disable=not is_progress_shown) as bar:

            async def worker() -> None:
                nonlocal num_sent
                for index in indices:
                    if time.perf_counter() >= deadline:
                        return
                    num_sent += 1
                    await soak.one(index)
                    bar.update(1)

            try:
                await asyncio.gather(*(worker() for _ in range(concurrency)))
            finally:
                await soak.drop_http.close()
        duration_s = time.perf_counter() - start
        kv = await _wait_idle(http, url, config.idle_timeout_s)
        metrics_after_status, metrics_after = await _get(http, url + "/metrics")
        has_metrics = metrics_after_status == 200 and "rill_requests_total" in metrics_after
        server_delta = _server_outcomes(metrics_after) - metrics_before if has_metrics else Counter()
        has_slow_readers = "rill_slow_readers_total" in metrics_after
        slow_readers_delta = server_delta.pop("slow_readers", 0) if has_slow_readers else None
        health_status, _ = await _get(http, url + "/health")
        ready_status, _ = await _get(http, url + "/ready")
    return SoakResult(
        capacity=capacity,
        concurrency=concurrency,
        num_sent=num_sent,
        duration_s=duration_s,
        outcomes=dict(sorted(soak.outcomes.items())),
        num_disconnects_sent=soak.num_disconnects_sent,
        num_disconnected=soak.outcomes["disconnected"],
        cancelled_delta=server_delta["cancelled"] if has_metrics else None,
        slow_readers_delta=slow_readers_delta,
        server_outcomes_delta=dict(sorted(server_delta.items())),
        leaked_kv_blocks=None if kv is None else int(kv.get("used_blocks", 0)),
        kv_after=kv,
        health_status=health_status,
        ready_status=ready_status,
        failure_examples=soak.failure_examples,
    )


def format_soak(title: str, result: SoakResult) -> str:
    outcomes = ", ".join(f"{kind} {count}" for kind, count in result.outcomes.items()) or "none"
    server = ", ".join(f"{kind} {count}" for kind, count in result.server_outcomes_delta.items()) or "-"
    leaked = "unknown (never idle)" if result.leaked_kv_blocks is None else str(result.leaked_kv_blocks)
    lines = [
        title,
        f"  {'capacity':<22}{result.capacity} (max_concurrent_requests); {result.concurrency} in flight",
        f"  {'sent':<22}{result.num_sent} in {result.duration_s:.1f} s "
        f"({result.num_sent / max(result.duration_s, 1e-9):.1f} requests/s)",
        f"  {'outcomes':<22}{outcomes}",
        f"  {'failures':<22}{result.num_failures} (other 5xx, non-JSON 4xx, stream errors, timeouts, "
        "connection errors)",
        f"  {'disconnects':<22}{result.num_disconnects_sent} drawn, {result.num_disconnected} dropped before "
        f"their end; server counted cancelled {result.cancelled_delta}",
        f"  {'slow readers':<22}{result.outcomes.get('slow-reader-cut', 0)} saw the cut-off; server counted "
        f"{result.slow_readers_delta}",
        f"  {'server outcomes':<22}{server}",
        f"  {'leaked KV blocks':<22}{leaked}  (kv after: {result.kv_after})",
        f"  {'health / ready':<22}{result.health_status} / {result.ready_status}",
        f"  {'verdict':<22}{'PASS' if result.is_ok else 'FAIL'}",
    ]
    lines += [f"  example: {example}" for example in result.failure_examples]
    return "\n".join(lines)


def soak_json(config: SoakConfig, result: SoakResult) -> dict[str, Any]:
    return {"soak_config": asdict(config), "result": {**asdict(result), "is_ok": result.is_ok}}
