"""End to end: the launcher with --num-shard N (gloo on the CPU) serves the same greedy outputs as one shard.

A tiny random Llama (4 query heads, 2 KV heads: split on 2 ranks, replicated on 4) with the default model's
tokenizer, and the default model itself on 3 ranks (its 9 query and 3 KV heads). Then a rank is killed under
load: the request in flight ends with an error instead of hanging, and the launcher stops everything and
exits non-zero naming the dead rank.
"""

from __future__ import annotations

import os
import re
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import requests

from .conftest import Server, start_server, stop_server

SUBJECTS = ("The river", "My neighbour's cat", "A distant star", "Every morning the baker")
VERBS = ("said", "was known for", "had never seen", "slowly turned toward")
PROMPTS = [f"{subject} {verb}" for subject in SUBJECTS for verb in VERBS]
SERVER_ARGS = ("--max-batch-tokens", "256", "--max-batch-total-tokens", "8192", "--max-batch-size", "16")


def greedy_outputs(server: Server, prompts: list[str], max_new_tokens: int) -> list[list[int]]:
    def one(prompt: str) -> list[int]:
        response = requests.post(
            f"{server.url}/generate",
            json={"inputs": prompt, "parameters": {"max_new_tokens": max_new_tokens, "details": True}},
            timeout=600,
        )
        assert response.status_code == 200, response.text
        return [token["id"] for token in response.json()["details"]["tokens"]]

    with ThreadPoolExecutor(len(prompts)) as pool:  # concurrently, so they share forward passes
        return list(pool.map(one, prompts))


def serve_and_generate(model: Path, tmp_path: Path, num_shard: int, prompts: list[str], max_new_tokens: int):
    server = start_server(model, tmp_path, "--num-shard", str(num_shard), *SERVER_ARGS)
    try:
        start = time.perf_counter()
        outputs = greedy_outputs(server, prompts, max_new_tokens)
        elapsed_s = time.perf_counter() - start
        assert server.wait_idle()["kv"]
    finally:
        stop_server(server)
    assert server.process.returncode == 0, server.log_path.read_text()[-3000:]
    print(f"num_shard={num_shard}: {len(prompts)} prompts x {max_new_tokens} tokens in {elapsed_s:.1f}s")
    return outputs


def test_greedy_outputs_identical_for_1_2_4_shards(tiny_model: Path, tmp_path: Path) -> None:
    expected = serve_and_generate(tiny_model, tmp_path, 1, PROMPTS, 24)
    assert all(len(tokens) == 24 for tokens in expected) and len({tuple(t) for t in expected}) > 1
    for num_shard in (2, 4):
        assert serve_and_generate(tiny_model, tmp_path, num_shard, PROMPTS, 24) == expected, num_shard


def test_default_model_on_3_shards_matches_1(default_model: Path, tmp_path: Path) -> None:
    prompts = PROMPTS[:4]
    expected = serve_and_generate(default_model, tmp_path, 1, prompts, 16)
    assert serve_and_generate(default_model, tmp_path, 3, prompts, 16) == expected


def test_killed_rank_fails_requests_and_stops_the_launcher(tiny_model: Path, tmp_path: Path) -> None:
    server = start_server(tiny_model, tmp_path, "--num-shard", "2", *SERVER_ARGS)
    try:
        pid = int(re.search(r"shard-1 has pid (\d+)", server.log_path.read_text()).group(1))
        response = requests.post(
            f"{server.url}/generate_stream",
            json={"inputs": PROMPTS[0], "parameters": {"max_new_tokens": 4000}},
            stream=True,
            timeout=60,
        )
        assert response.status_code == 200, response.text
        lines = response.iter_lines()
        first = next(line for line in lines if line.startswith(b"data:"))
        assert b'"token"' in first, first
        os.kill(pid, signal.SIGKILL)
        started = time.monotonic()
        rest = []
        try:
            rest = [line for line in lines if line.startswith(b"data:")]
        except requests.exceptions.RequestException:
            pass  # the router was stopped mid-stream: the request ended with an error too
        assert time.monotonic() - started < 60
        # No successful end: either an error event or a cut stream, never `generated_text` after 4000 tokens.
        assert not rest or b'"error"' in rest[-1] or b'generated_text":null' in rest[-1], rest[-1:]
        server.process.wait(timeout=60)
    finally:
        stop_server(server)
    log = server.log_path.read_text()
    assert server.process.returncode == 1, log[-3000:]
    assert "shard-1 exited with code -9 (killed by SIGKILL)" in log, log[-3000:]
