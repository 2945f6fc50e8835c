"""End to end: 32 concurrent streamed generations on a KV pool far too small for all of them, under each
preemption mode (recompute, swap, auto) and under `--kv-admission reserve`.

Every request completes; its greedy tokens are those a roomy pool gives; each streamed token arrives exactly
once (the stream's tokens are the final text, token for token); the preemption counters moved; and when the
server is idle the KV pool and the swap pool are whole. A tiny random Llama with the default model's tokenizer
keeps it cheap on the CPU.
"""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import requests

from .conftest import Server, start_server, stop_server

PROMPTS = [f"Request {i}: the story of the number {i * 7} goes" for i in range(32)]
MAX_NEW_TOKENS = 40
COMMON_ARGS = ("--max-batch-tokens", "256", "--max-batch-size", "32", "--max-input-tokens", "64",
               "--max-total-tokens", "128", "--max-concurrent-requests", "64")  # fmt: skip
# 24 blocks of 16 tokens: room for about 7 of the 32 requests at their full length.
TINY_POOL = ("--max-batch-total-tokens", "384", "--swap-space", "0.01")
SWAPPED_IN = "rill_swapped_in_blocks_total"
ROOMY_POOL = ("--max-batch-total-tokens", "8192", "--preemption-mode", "recompute")


def stream(server: Server, prompt: str) -> tuple[list[int], str]:
    """Streams one greedy generation; returns its token ids and the final text, checking that the streamed
    tokens make up that text exactly once each."""
    response = requests.post(
        f"{server.url}/generate_stream",
        json={"inputs": prompt, "parameters": {"max_new_tokens": MAX_NEW_TOKENS, "details": True}},
        stream=True,
        timeout=600,
    )
    assert response.status_code == 200, response.text
    events = [
        json.loads(line[len(b"data:") :].decode("utf-8"))
        for line in response.iter_lines(decode_unicode=False)
        if line.startswith(b"data:")
    ]
    assert events and all("error" not in event for event in events), events[-1:]
    final = events[-1]
    assert final["generated_text"] is not None
    assert "".join(event["token"]["text"] for event in events) == final["generated_text"]
    assert all(event["generated_text"] is None for event in events[:-1])
    assert len(events) == final["details"]["generated_tokens"]
    return [event["token"]["id"] for event in events], final["generated_text"]


def run_all(server: Server) -> list[list[int]]:
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        return [tokens for tokens, _ in pool.map(lambda prompt: stream(server, prompt), PROMPTS)]


def metric(text: str, name: str) -> float:
    match = re.search(rf"^{re.escape(name)} (\S+)$", text, re.MULTILINE)
    assert match, f"{name} not in /metrics"
    return float(match.group(1))


def serve(model: Path, tmp_path: Path, *args: str) -> tuple[list[list[int]], str]:
    """Runs every prompt at once on a server with `args`; returns the tokens and /metrics after checking
    that the pools are whole."""
    server = start_server(model, tmp_path, *COMMON_ARGS, *args)
    try:
        outputs = run_all(server)
        kv = server.wait_idle()["kv"]
        metrics = requests.get(f"{server.url}/metrics", timeout=10).text
    finally:
        stop_server(server)
    assert server.process.returncode == 0, server.log_path.read_text()[-3000:]
    assert kv["used_blocks"] == 0 and kv["free_blocks"] + kv["cached_blocks"] == kv["total_blocks"], kv
    assert metric(metrics, "rill_swapped_sequences") == 0
    assert metric(metrics, "rill_swap_blocks_free") == metric(metrics, "rill_swap_blocks_total")
    return outputs, metrics


@pytest.fixture(scope="module")
def expected(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> list[list[int]]:
    outputs, metrics = serve(tiny_model, tmp_path_factory.mktemp("roomy"), *ROOMY_POOL)
    assert metric(metrics, 'rill_preemptions_total{mode="recompute"}') == 0
    assert len({tuple(tokens) for tokens in outputs}) > 1
    return outputs


@pytest.mark.parametrize(
    ("args", "counters"),
    [
        (("--preemption-mode", "recompute"), ('rill_preemptions_total{mode="recompute"}',)),
        (("--preemption-mode", "swap"), ('rill_preemptions_total{mode="swap"}', SWAPPED_IN)),
        (("--preemption-mode", "auto"), ()),
        (("--kv-admission", "reserve"), ()),
    ],
    ids=["recompute", "swap", "auto", "reserve"],
)
def test_tiny_pool_gives_roomy_outputs(
    tiny_model: Path,
    tmp_path: Path,
    expected: list[list[int]],
    args: tuple[str, ...],
    counters: tuple[str, ...],
) -> None:
    outputs, metrics = serve(tiny_model, tmp_path, *TINY_POOL, *args)
    assert outputs == expected
    preemptions = {
        mode: metric(metrics, f'rill_preemptions_total{{mode="{mode}"}}') for mode in ("recompute", "swap")
    }
    print(f"{' '.join(args)}: preemptions {preemptions}")
    for counter in counters:
        assert metric(metrics, counter) > 0, counter
    if "reserve" in args:
        assert sum(preemptions.values()) == 0
    else:
        assert sum(preemptions.values()) > 0
    assert metric(metrics, "rill_swapped_in_blocks_total") == metric(metrics, "rill_swapped_out_blocks_total")
    if preemptions["recompute"] and "swap" not in args:
        assert metric(metrics, "rill_recomputed_tokens_total") > 0
