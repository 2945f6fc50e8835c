"""Agent sessions under a churning cache: does each turn of an agent find its history in the prefix cache?

    python -m bench.suite agents [--num-agents 4] [--num-turns 5] [--think-s 3]

`--num-agents` agents run `--num-turns` turns each, concurrently. A turn sends the conversation so far plus
a tool result of a realistic size (`TOOL_RESULT_TOKENS`, seeded random text), streams the answer (greedy, at
most `ANSWER_TOKENS` tokens), then thinks (`--think-s`, the time a tool takes) before the next turn. Meanwhile
a competing load sends unrelated long prompts without pause, so an idle session's blocks are evicted from the
small KV pool unless something holds them. The same seeded sessions run three ways, each against its own
fresh server (one at a time, so each has the machine):

- `chat`: `/v1/chat/completions`, the client re-sending (and the server re-rendering) the whole history;
- `chat+pin`: the same with `prompt_cache_key` (one key per agent), which pins each turn's prefix;
- `responses`: `/v1/responses` with `previous_response_id`, the server continuing its stored token history.

Per turn it prints how much of what the agent sent before was served from the cache, the share of the prompt
served from it, and the TTFT p50, side by side, and how many cached blocks the churn evicted.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from bench.client import sse_events
from bench.harness import metrics, rill
from bench.workloads import TextSource

MODES = ("chat", "chat+pin", "responses")
SYSTEM_TOKENS = 120  # the agent's instructions
TASK_TOKENS = 40  # the user's task, turn 0
TOOL_RESULT_TOKENS = (80, 200)  # a tool's output, drawn per turn
ANSWER_TOKENS = 24
CHURN_PROMPT_TOKENS = 800
# A pool the churn turns over while an agent thinks, with room for every agent's whole session in pins.
SERVER_FLAGS = [
    "--max-batch-total-tokens",
    "6144",
    "--max-batch-tokens",
    "2048",
    "--max-pinned-kv-fraction",
    "0.5",
]


@dataclass
class Turn:
    """One request of one agent: what the server reported and how long the first token took."""

    agent: int
    turn: int
    prompt_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0
    ttft_s: float | None = None
    error: str | None = None


@dataclass
class AgentScript:
    """One agent's seeded texts: its instructions, its task and the tool result of each later turn."""

    system: str
    task: str
    tool_results: list[str] = field(default_factory=list)


def scripts(args: argparse.Namespace) -> list[AgentScript]:
    text = TextSource()
    rng = random.Random(args.seed)
    return [
        AgentScript(
            system="You are a coding agent. " + text.text(rng, SYSTEM_TOKENS),
            task="Task: " + text.text(rng, TASK_TOKENS),
            tool_results=[
                "Tool output:\n" + text.text(rng, rng.randint(*TOOL_RESULT_TOKENS))
                for _ in range(args.num_turns - 1)
            ],
        )
        for _ in range(args.num_agents)
    ]


async def stream_chat(http: aiohttp.ClientSession, url: str, body: dict[str, Any], record: Turn) -> str:
    """Streams one chat completion; fills `record` from its first token and its final usage chunk."""
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    answer = ""
    async with http.post(f"{url}/v1/chat/completions", json=body) as response:
        if response.status != 200:
            record.error = f"{response.status}: {(await response.text())[:200]}"
            return answer
        async for _, data in sse_events(response):
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            for choice in chunk.get("choices") or []:
                piece = choice["delta"].get("content") or ""
                if piece and record.ttft_s is None:
                    record.ttft_s = time.perf_counter() - start
                answer += piece
            if chunk.get("usage"):
                usage = chunk["usage"]
                record.prompt_tokens = usage["prompt_tokens"]
                record.output_tokens = usage["completion_tokens"]
                record.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return answer


async def stream_response(
    http: aiohttp.ClientSession, url: str, body: dict[str, Any], record: Turn
) -> str | None:
    """Streams one Responses turn; fills `record`; returns the response's id."""
    start = time.perf_counter()
    response_id = None
    async with http.post(f"{url}/v1/responses", json={**body, "stream": True}) as response:
        if response.status != 200:
            record.error = f"{response.status}: {(await response.text())[:200]}"
            return None
        async for _, data in sse_events(response):
            event = json.loads(data)
            kind = event.get("type")
            if kind == "response.output_text.delta" and event.get("delta") and record.ttft_s is None:
                record.ttft_s = time.perf_counter() - start
            elif kind in ("response.completed", "response.incomplete"):
                done = event["response"]
                response_id = done["id"]
                usage = done["usage"]
                record.prompt_tokens = usage["input_tokens"]
                record.output_tokens = usage["output_tokens"]
                record.cached_tokens = (usage.get("input_tokens_details") or {}).get("cached_tokens") or 0
            elif kind in ("error", "response.failed"):
                record.error = data[:200]
    return response_id


async def run_agent(
    http: aiohttp.ClientSession,
    url: str,
    model: str,
    mode: str,
    index: int,
    script: AgentScript,
    args: argparse.Namespace,
) -> list[Turn]:
    turns: list[Turn] = []
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": script.system},
        {"role": "user", "content": script.task},
    ]
    previous_id: str | None = None
    sampling = {"model": model, "temperature": 0}
    for turn in range(args.num_turns):
        record = Turn(index, turn)
        if mode == "responses":
            new_input = script.task if turn == 0 else script.tool_results[turn - 1]
            body: dict[str, Any] = {**sampling, "input": new_input, "max_output_tokens": ANSWER_TOKENS}
            # Instructions are not carried over by `previous_response_id`: agents send them every turn.
            body["instructions"] = script.system
            if previous_id is not None:
                body["previous_response_id"] = previous_id
            previous_id = await stream_response(http, url, body, record)
        else:
            body = {**sampling, "messages": messages, "max_tokens": ANSWER_TOKENS}
            if mode == "chat+pin":
                body["prompt_cache_key"] = f"agent-{index}"
            answer = await stream_chat(http, url, body, record)
            if turn + 1 < args.num_turns:
                messages.append({"role": "assistant", "content": answer})
                messages.append({"role": "user", "content": script.tool_results[turn]})
        turns.append(record)
        if record.error is not None:
            break
        await asyncio.sleep(args.think_s)
    return turns


async def churn(http: aiohttp.ClientSession, url: str, model: str, stop: asyncio.Event, seed: int) -> int:
    """Unrelated long prompts, one after another, until `stop`; returns how many were sent."""
    text, rng = TextSource(), random.Random(seed)
    sent = 0
    while not stop.is_set():
        body = {"model": model, "prompt": text.text(rng, CHURN_PROMPT_TOKENS), "max_tokens": 1}
        async with http.post(f"{url}/v1/completions", json=body) as response:
            if response.status != 200:
                raise RuntimeError(f"a churn request failed: {response.status} {await response.text()}")
            await response.read()
        sent += 1
    return sent


async def run_mode(url: str, mode: str, args: argparse.Namespace) -> tuple[list[Turn], int]:
    timeout = aiohttp.ClientTimeout(total=900)
    # A connection per request: the server closes idle keep-alive connections while an agent thinks.
    connector = aiohttp.TCPConnector(force_close=True)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as http:
        async with http.get(f"{url}/v1/models") as response:
            model = (await response.json())["data"][0]["id"]
        stop = asyncio.Event()
        churner = asyncio.create_task(churn(http, url, model, stop, args.seed + 1))
        agents = [
            run_agent(http, url, model, mode, i, script, args) for i, script in enumerate(scripts(args))
        ]
        try:
            results = await asyncio.gather(*agents)
        finally:
            stop.set()
        churned = await churner
    return [turn for agent in results for turn in agent], churned


def per_turn(turns: list[Turn], num_turns: int) -> list[dict[str, float | None]]:
    """Per turn over all agents: `history_hit`, the cached tokens over the tokens the agent's previous turn
    already sent the server (its prompt and answer: all a cache could hold; the cache holds whole blocks, so
    up to a block short of 1.0), `prompt_hit`, cached over all prompt tokens, and the TTFT p50."""
    by_key = {(t.agent, t.turn): t for t in turns if t.error is None}
    rows = []
    for index in range(num_turns):
        done = [t for t in by_key.values() if t.turn == index]
        previous = [by_key.get((t.agent, index - 1)) for t in done]
        history = sum(p.prompt_tokens + p.output_tokens for p in previous if p is not None)
        cached = sum(t.cached_tokens for t in done)
        prompt = sum(t.prompt_tokens for t in done)
        ttfts = [t.ttft_s for t in done if t.ttft_s is not None]
        rows.append({
            "requests": len(done),
            "history_hit": cached / history if history else None,
            "prompt_hit": cached / prompt if prompt else None,
            "ttft_ms_p50": 1e3 * statistics.median(ttfts) if ttfts else None,
        })  # fmt: skip
    return rows


def run(args: argparse.Namespace) -> dict[str, Any]:
    report: dict[str, Any] = {}
    for mode in MODES:
        with rill(args, f"agents-{mode}", *SERVER_FLAGS) as server:
            before = metrics(server)
            turns, churned = asyncio.run(run_mode(server.url, mode, args))
            after = metrics(server)
        errors = [t.error for t in turns if t.error is not None]
        evicted = "rill_prefix_cache_evicted_blocks_total"
        report[mode] = {
            "turns": per_turn(turns, args.num_turns),
            "errors": errors,
            "churn_requests": churned,
            "evicted_blocks": after[evicted] - before[evicted],
        }
        print(f"[agents] {mode}: {len(turns)} turns, {len(errors)} errors, {churned} churn requests, "
              f"{report[mode]['evicted_blocks']:.0f} cached blocks evicted", flush=True)  # fmt: skip
        if errors:
            raise RuntimeError(f"{mode}: {len(errors)} turns failed, the first: {errors[0]}")
    print("\nper turn, over all agents: cached tokens / the previous turn's prompt + answer (history), "
          "cached / prompt, TTFT p50")  # fmt: skip
    print("turn | " + " | ".join(f"{mode:^26}" for mode in MODES))
    for index in range(args.num_turns):
        cells = []
        for mode in MODES:
            row = report[mode]["turns"][index]
            ttft = "    n/a" if row["ttft_ms_p50"] is None else f"{row['ttft_ms_p50']:5.0f} ms"
            cells.append(f"{percent(row['history_hit'])} {percent(row['prompt_hit'])} {ttft}")
        print(f"{index + 1:>4} | " + " | ".join(f"{cell:>26}" for cell in cells))
    return report


def percent(value: float | None) -> str:
    return "  n/a" if value is None else f"{100 * value:4.0f}%"
