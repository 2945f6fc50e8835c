"""End to end: exact routing from KV-cache events. Two real replicas (`python -m rill`, each publishing
its prefix cache's events with `--kv-events-endpoint`) and llm-d's own indexer, llm-d-kv-cache v0.9.0 (its
kvevents pool, KV-block index and longest-prefix scorer, driven by the Go program in tests/kv_indexer/),
subscribed to both. For every prompt the indexer must name the replica whose prefix cache holds the longest
prefix of it, and exactly how long each replica's is: after distinct prompt families went to each replica,
after one replica evicted all of them, and after the other replica's shard restart cleared its cache. The
ground truth is what was sent where; every response's `cached_tokens` checks it against the replica's own
cache as the test goes."""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import requests

from bench.servers import free_port

from .conftest import Server, start_server, stop_server

BLOCK_SIZE = 16
# 64 blocks per replica: the first phase fits in it, the flood of the second overflows it three times.
KV_TOKENS = 1024
FLAGS = (
    "--max-batch-tokens", "256", "--max-batch-total-tokens", str(KV_TOKENS), "--max-input-tokens", "512",
    "--max-total-tokens", "600", "--restart-shards",
)  # fmt: skip
INDEXER_SOURCE = Path(__file__).parents[1] / "kv_indexer"
# An answer waits until no event arrived for this long; events trail the responses (the router queues them).
QUIET_MS = 500


def tokens(seed: int, num_tokens: int) -> list[int]:
    """Random token ids: two seeds share no block."""
    rng = random.Random(seed)
    return [rng.randrange(100, 40000) for _ in range(num_tokens)]


def common_prefix_tokens(prompt: list[int], held: list[int]) -> int:
    """The whole blocks `prompt` starts with that `held` (a cached prompt) holds, in tokens."""
    num_tokens = 0
    while num_tokens + BLOCK_SIZE <= min(len(prompt), len(held)) and (
        prompt[num_tokens : num_tokens + BLOCK_SIZE] == held[num_tokens : num_tokens + BLOCK_SIZE]
    ):
        num_tokens += BLOCK_SIZE
    return num_tokens


@dataclass
class Replica:
    server: Server
    # The pod name in its events' topic, and the endpoint the indexer connects to.
    pod: str
    events_endpoint: str
    model: str
    # The ground truth: the prompts whose whole blocks the replica's prefix cache holds (with max_tokens=1
    # nothing but the prompt is computed).
    held: list[list[int]] = field(default_factory=list)

    def cached_tokens(self, prompt: list[int]) -> int:
        return max((common_prefix_tokens(prompt, held) for held in self.held), default=0)

    def send(self, prompt: list[int]) -> None:
        """Sends `prompt`, checking the replica's own `cached_tokens` against the ground truth (the last token
        is always computed for its logits, so a prompt ending on a block boundary reuses one block less)."""
        expected = min(self.cached_tokens(prompt), (len(prompt) - 1) // BLOCK_SIZE * BLOCK_SIZE)
        body = {"model": self.model, "prompt": prompt, "max_tokens": 1, "temperature": 0}
        response = requests.post(f"{self.server.url}/v1/completions", json=body, timeout=120)
        assert response.status_code == 200, response.text
        cached = response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached == expected, f"{self.pod} had {cached} tokens of a prompt cached, not {expected}"
        self.held.append(prompt)


class Indexer:
    """The Go program: a session line, then one JSON line per query (tests/kv_indexer/main.go)."""

    def __init__(self, binary: Path, replicas: tuple[Replica, ...], log_path: Path) -> None:
        self.log_path = log_path
        self.process = subprocess.Popen(
            [binary], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log_path.open("w"), text=True
        )
        session = {
            "model": replicas[0].model,
            "block_size": BLOCK_SIZE,
            "replicas": [{"pod": r.pod, "endpoint": r.events_endpoint} for r in replicas],
        }
        self._write(session)

    def _write(self, line: dict[str, Any]) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps(line) + "\n")
        self.process.stdin.flush()

    def ask(self, prompts: list[list[int]], quiet_ms: int = QUIET_MS) -> dict[str, Any]:
        self._write({"prompts": prompts, "quiet_ms": quiet_ms})
        assert self.process.stdout is not None
        line = self.process.stdout.readline()
        assert line, f"the indexer exited: {self.log_path.read_text()[-3000:]}"
        return json.loads(line)

    def close(self) -> None:
        assert self.process.stdin is not None
        self.process.stdin.close()
        assert self.process.wait(30) == 0, self.log_path.read_text()[-3000:]


@pytest.fixture(scope="module")
def indexer_binary() -> Path:
    """The Go program, built once per source version into $HOME/.cache/rill-ci (the first build downloads
    llm-d-kv-cache and its modules from the Go module proxy)."""
    go = shutil.which("go")
    if go is None:
        pytest.skip("Go is not installed (llm-d's indexer is a Go module)")
    digest = hashlib.sha256()
    for name in ("go.mod", "go.sum", "main.go"):
        digest.update((INDEXER_SOURCE / name).read_bytes())
    binary = Path.home() / ".cache" / "rill-ci" / f"kv_indexer-{digest.hexdigest()[:16]}"
    if not binary.exists():
        binary.parent.mkdir(parents=True, exist_ok=True)
        partial = binary.with_suffix(".partial")
        subprocess.run([go, "build", "-o", str(partial), "."], cwd=INDEXER_SOURCE, check=True, timeout=1800)
        partial.rename(binary)
    return binary


@pytest.fixture(scope="module")
def replicas(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Replica, Replica]]:
    """Two replicas, each binding its events socket (`tcp://*:PORT`, as in Kubernetes); the indexer connects
    to 127.0.0.1. Each publishes under the default topic, `kv@127.0.0.1:PORT@MODEL`."""
    started: list[tuple[Server, int]] = []
    try:
        for name in ("a", "b"):
            events_port = free_port()
            tmp_dir = tmp_path_factory.mktemp(f"kv-indexer-{name}")
            flags = (*FLAGS, "--kv-events-endpoint", f"tcp://*:{events_port}")
            started.append((start_server(tiny_model, tmp_dir, *flags), events_port))
        pair = []
        for server, events_port in started:
            model = requests.get(f"{server.url}/v1/models", timeout=10).json()["data"][0]["id"]
            assert server.info()["kv"]["block_size"] == BLOCK_SIZE
            pod = server.url.removeprefix("http://")
            pair.append(Replica(server, pod, f"tcp://127.0.0.1:{events_port}", model))
        yield pair[0], pair[1]
    finally:
        for server, _ in started:
            stop_server(server)
    for server, _ in started:
        assert server.process.returncode == 0, server.log_path.read_text()[-3000:]


def expected_route(replicas: tuple[Replica, ...], prompt: list[int]) -> tuple[dict[str, int], str | None]:
    """The indexer's answer if it knows exactly what each replica holds: each replica's cached prefix of
    `prompt` (when it has one) and the replica with the longest (None for none or a tie)."""
    cached = {r.pod: r.cached_tokens(prompt) for r in replicas if r.cached_tokens(prompt) > 0}
    longest = max(cached.values(), default=0)
    leaders = [pod for pod, num_tokens in cached.items() if num_tokens == longest]
    return cached, leaders[0] if len(leaders) == 1 else None


def check_routing(indexer: Indexer, replicas: tuple[Replica, ...], prompts: dict[str, list[int]]) -> None:
    """Every prompt routed exactly as the ground truth says, once the replicas are idle and their event
    streams quiet."""
    for replica in replicas:
        replica.server.wait_idle()
    answer = indexer.ask(list(prompts.values()))
    assert answer["settled"], answer["batches"]
    routed = {
        name: (r["cached_tokens"], r["best"]) for name, r in zip(prompts, answer["results"], strict=True)
    }
    expected = {name: expected_route(replicas, prompt) for name, prompt in prompts.items()}
    wrong = {name: (routed[name], expected[name]) for name in prompts if routed[name] != expected[name]}
    assert not wrong, f"{len(wrong)} of {len(prompts)} prompts misrouted (got, want): {wrong}"


def restart_shard(replica: Replica) -> None:
    """Kills the replica's shard under a running request (so the router sees it fail, as in
    tests/e2e/test_restart.py); the launcher (--restart-shards) starts a fresh one with an empty KV pool."""
    body = {"model": replica.model, "prompt": tokens(5, 20), "max_tokens": 400, "ignore_eos": True}
    in_flight = threading.Thread(
        target=requests.post,
        args=(f"{replica.server.url}/v1/completions",),
        kwargs={"json": body, "timeout": 120},
    )
    in_flight.start()
    while replica.server.info()["kv"]["running_requests"] == 0:
        time.sleep(0.05)
    pids = re.findall(r"shard-0 has pid (\d+)", replica.server.log_path.read_text())
    os.kill(int(pids[-1]), signal.SIGKILL)
    in_flight.join(60)
    # The router swaps in the new pool (and records AllBlocksCleared) once it warmed the new shard up.
    deadline = time.monotonic() + 180
    while "the shards are back; serving again" not in replica.server.log_path.read_text():
        assert time.monotonic() < deadline, "the shard did not come back"
        time.sleep(0.5)
    replica.held.clear()


def test_the_indexer_routes_every_prompt_to_the_replica_with_its_longest_cached_prefix(
    indexer_binary: Path, replicas: tuple[Replica, Replica], tmp_path: Path
) -> None:
    a, b = replicas
    indexer = Indexer(indexer_binary, replicas, tmp_path / "indexer.log")
    try:
        # A PUB socket only sends to subscriptions it knows: send until a batch from each replica shows.
        for i, replica in enumerate(replicas):
            for attempt in range(30):
                replica.send(tokens(1000 + 100 * i + attempt, 40))
                if indexer.ask([], quiet_ms=200)["batches"][replica.pod] > 0:
                    break
            else:
                raise AssertionError(f"no event batch from {replica.pod} reached the indexer")

        # Phase 1: a family of prompts (a 3-block system prompt and different questions) to each replica, and
        # a 2-block prefix both hold, one with a longer continuation on a, the other on b.
        system_a, system_b, shared = tokens(1, 48), tokens(2, 48), tokens(3, 32)
        sent = {
            "a1": (a, system_a + tokens(11, 21)),
            "a2": (a, system_a + tokens(12, 37)),
            "b1": (b, system_b + tokens(21, 21)),
            "b2": (b, system_b + tokens(22, 37)),
            "shared+a": (a, shared + tokens(31, 40)),
            "shared+b": (b, shared + tokens(32, 21)),
        }
        for replica, prompt in sent.values():
            replica.send(prompt)
        prompts = {name: prompt for name, (_, prompt) in sent.items()}
        prompts |= {
            "system_a+new": system_a + tokens(13, 12),
            "system_b+new": system_b + tokens(23, 30),
            "shared+new": shared + tokens(33, 20),  # a tie: both hold 2 blocks
            "unrelated": tokens(4, 70),
            "shorter than a block": system_a[:15],
        }
        assert {expected_route(replicas, p)[1] for p in prompts.values()} == {a.pod, b.pod, None}
        check_routing(indexer, replicas, prompts)

        # Phase 2: a flood of new prompts (24 x 8 blocks through a's 64) evicts everything phase 1 left on a;
        # the least recently used blocks go first, so only the last flood prompts stay.
        flood = [tokens(100 + i, 8 * BLOCK_SIZE + 5) for i in range(24)]
        for prompt in flood:
            a.send(prompt)
        a.held = [flood[-1]]
        prompts |= {"flood first": flood[0], "flood last": flood[-1]}
        check_routing(indexer, replicas, prompts)
        # The replica agrees: nothing of phase 1 is left on a (send checks cached_tokens).
        a.send(prompts["a1"])
        a.send(prompts["shared+a"])

        # Phase 3: b's shard restarts with an empty pool; the router says AllBlocksCleared.
        restart_shard(b)
        check_routing(indexer, replicas, prompts)
        b.send(prompts["b1"])  # b agrees: nothing cached
        check_routing(indexer, replicas, prompts)
    finally:
        indexer.close()
