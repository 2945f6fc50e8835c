"""Two Rill replicas behind smg (the Shepherd Model Gateway, SGLang's router's successor) with its cache-aware
policy: every request succeeds, streams too; requests sharing a long prefix land on the replica that holds it;
new prefixes go to the other replica while one is loaded; smg polls each replica's `GET /v1/loads`; and on
the same workload the replicas' prefix-cache hit rate through cache-aware routing beats round robin's.

Which replica served a request is read from the replicas themselves: the `rill_requests_total` and
`rill_prefix_cache_*_tokens_total` counters of their /metrics, and the `http request` lines of their logs.
Needs `smg` (PyPI, in the dev extra); skipped otherwise. Each replica is the default model on the CPU with
one thread, so two fit on a small machine next to other tests.
"""

from __future__ import annotations

import json
import random
import shutil
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
import requests

from bench import servers
from bench.servers import free_port
from tests.e2e.conftest import Server, start_servers, stop_server

SMG = shutil.which("smg") or shutil.which("smg", path=str(Path(sys.executable).parent))
pytestmark = pytest.mark.skipif(SMG is None, reason="smg is not installed (the dev extra has it)")

REPLICA_ARGS = (
    "--max-batch-total-tokens", "8192",  # room for every prefix of the module in each replica's cache
    "--max-batch-tokens", "512",
    "--max-batch-size", "8",
    "--max-concurrent-requests", "16",
)  # fmt: skip
# Cache-aware routing leaves prefix affinity for the shortest queue when the replicas' in-flight counts
# differ by more than BALANCE_ABS and the larger is over 1.5 times the smaller: smg's default (64) suits
# fleets serving hundreds of requests each; two one-thread replicas are loaded by a handful.
BALANCE_ABS = 2
WORDS = (
    "river stone garden lamp window paper silver forest candle harbor meadow engine violin marble ladder "
    "copper island basket mirror thunder orchard pencil canyon saddle lantern velvet glacier anchor kettle "
    "falcon tunnel quartz blanket compass meadow harvest feather bridge cinnamon prairie"
).split()


@dataclass
class Gateway:
    """smg's address, and the model name it routes by (smg requires the OpenAI `model` field)."""

    url: str
    model: str

    def complete(self, prompt: str, max_tokens: int = 2) -> dict:
        body = {"model": self.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
        response = requests.post(f"{self.url}/v1/completions", json=body, timeout=300)
        assert response.status_code == 200, response.text
        return response.json()

    def stream_chat(self, content: str, max_tokens: int) -> str:
        """A streamed chat completion; returns the text of its chunks, once [DONE] came."""
        body = {
            "model": self.model,
            "messages": [{"role": "user", "content": content}],
            "max_tokens": max_tokens,
            "temperature": 0,
            "stream": True,
        }
        url = f"{self.url}/v1/chat/completions"
        with requests.post(url, json=body, stream=True, timeout=300) as response:
            assert response.status_code == 200, response.text
            assert response.headers["content-type"].startswith("text/event-stream")
            data = [line[len(b"data: ") :] for line in response.iter_lines() if line.startswith(b"data: ")]
        assert data and data[-1] == b"[DONE]", data[-3:]
        chunks = [json.loads(item) for item in data[:-1]]
        return "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])


@dataclass
class Replicas:
    servers: list[Server]

    def counters(self) -> list[dict[str, float]]:
        """Per replica: successful requests, prompt tokens looked up in and found in its prefix cache."""
        names = {
            'rill_requests_total{outcome="success"}': "success",
            "rill_prefix_cache_queried_tokens_total": "queried",
            "rill_prefix_cache_hit_tokens_total": "hit",
        }
        result = []
        for server in self.servers:
            values = {"success": 0.0}  # a labelled counter is exported from its first request on
            for line in requests.get(f"{server.url}/metrics", timeout=10).text.splitlines():
                name, _, value = line.rpartition(" ")
                if name in names:
                    values[names[name]] = float(value)
            assert values.keys() == set(names.values()), f"{server.url}/metrics lacks some of {names}"
            result.append(values)
        return result

    def served_by(self, gateway: Gateway, prompt: str) -> int:
        """Sends a completion of `prompt` through `gateway` and returns the index of the one replica whose
        success count moved."""
        before = [c["success"] for c in self.counters()]
        gateway.complete(prompt)
        after = [c["success"] for c in self.counters()]
        moved = [index for index, (b, a) in enumerate(zip(before, after, strict=True)) if a != b]
        assert len(moved) == 1 and after[moved[0]] == before[moved[0]] + 1, (before, after)
        return moved[0]


@pytest.fixture(scope="module")
def replicas(default_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Replicas]:
    tmp_dir = tmp_path_factory.mktemp("smg_replicas")
    started = start_servers(default_model, tmp_dir, *REPLICA_ARGS)
    yield Replicas(started)
    for server in started:
        stop_server(server)


@contextmanager
def smg(replicas: Replicas, policy: str, tmp_dir: Path) -> Iterator[Gateway]:
    """`smg launch` in front of the replicas with `policy`; yields its URL once it has both workers."""
    port = free_port()
    command = [
        SMG, "launch", "--host", "127.0.0.1", "--port", str(port),
        "--worker-urls", *(server.url for server in replicas.servers),
        "--policy", policy,
        "--balance-abs-threshold", str(BALANCE_ABS), "--balance-rel-threshold", "1.5",
        "--load-monitor-interval", "1",  # seconds between its GET /v1/loads to each replica
        "--worker-startup-check-interval", "1",
        "--prometheus-port", str(free_port()), "--prometheus-host", "127.0.0.1",
        "--log-level", "info",
    ]  # fmt: skip
    log_path = tmp_dir / f"smg-{policy}-{port}.log"
    gateway = servers.start(command, port, log_path, what=f"smg ({policy})", timeout_s=120)
    try:
        servers.wait_until(
            lambda: len(requests.get(f"{gateway.url}/workers", timeout=5).json().get("workers", [])) == 2,
            gateway.process, "smg's two workers", log_path, timeout_s=60,
        )  # fmt: skip
        model = requests.get(f"{replicas.servers[0].url}/v1/models", timeout=10).json()["data"][0]["id"]
        yield Gateway(gateway.url, model)
    finally:
        servers.stop(gateway.process, grace_s=10)


@pytest.fixture(scope="module")
def gateway(replicas: Replicas, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    with smg(replicas, "cache_aware", tmp_path_factory.mktemp("smg")) as started:
        yield started


def words(seed: int, count: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(count))


def test_every_request_succeeds_streaming_too(replicas: Replicas, gateway: Gateway) -> None:
    before = sum(c["success"] for c in replicas.counters())

    def one(index: int) -> None:
        if index % 2:
            assert gateway.stream_chat(f"Request {index}: name a colour.", max_tokens=6)
        else:
            assert gateway.complete(f"Request {index}: the sky is", max_tokens=6)["choices"][0]["text"]

    with ThreadPoolExecutor(6) as pool:
        list(pool.map(one, range(12)))
    # Each request reached a replica once and succeeded there.
    assert sum(c["success"] for c in replicas.counters()) == before + 12


def test_shared_prefix_lands_on_the_replica_that_holds_it(replicas: Replicas, gateway: Gateway) -> None:
    prefix = words(seed=1, count=300) + "\n"
    first = replicas.served_by(gateway, prefix + "Question 0: what came first?")
    before = replicas.counters()
    for index in range(1, 7):
        served = replicas.served_by(gateway, prefix + f"Question {index}: what came next?")
        assert served == first, f"request {index} with the prefix went to replica {served}, not {first}"
    after = replicas.counters()
    # The holder found the prefix in its cache each time (at least 256 of its ~300 tokens, whole blocks).
    assert after[first]["hit"] - before[first]["hit"] >= 6 * 256, (before, after)


def test_new_prefixes_avoid_a_loaded_replica(replicas: Replicas, gateway: Gateway) -> None:
    # Unloaded, new prefixes spread over both replicas.
    spread = {replicas.served_by(gateway, words(seed=100 + i, count=200)) for i in range(6)}
    assert spread == {0, 1}, f"6 new prefixes all went to replica {spread}"

    # Load one replica with long streams that share a prefix (so all go to its holder).
    prefix = words(seed=2, count=150)
    loaded = replicas.served_by(gateway, prefix + " warm up")
    streams = [
        threading.Thread(target=gateway.stream_chat, args=(prefix + f" story {i}", 400)) for i in range(3)
    ]
    for thread in streams:
        thread.start()
    try:
        deadline = time.monotonic() + 60
        while replicas.servers[loaded].info()["kv"]["running_requests"] < 3:
            assert time.monotonic() < deadline, "the streams did not all reach the loaded replica"
            time.sleep(0.1)
        # New prefixes now take the shortest queue: the other replica.
        others = [replicas.served_by(gateway, words(seed=200 + i, count=200)) for i in range(4)]
        assert others == [1 - loaded] * 4, f"replica {loaded} was loaded; new prefixes went to {others}"
    finally:
        for thread in streams:
            thread.join()


def test_smg_polls_and_reads_each_replicas_loads(replicas: Replicas, gateway: Gateway) -> None:
    def loads_calls(server: Server) -> int:
        return server.log_path.read_text(errors="replace").count('"/v1/loads"')  # the `path` field

    before = [loads_calls(server) for server in replicas.servers]
    time.sleep(3)  # --load-monitor-interval 1
    after = [loads_calls(server) for server in replicas.servers]
    polled = all(a >= b + 2 for a, b in zip(after, before, strict=True))
    assert polled, f"GET /v1/loads per replica: {before} -> {after}"
    # ... and reads the answers: smg's own view of each worker's load carries the replica's KV pool size and
    # batch limit, which only Rill's /v1/loads says.
    smg_loads = requests.get(f"{gateway.url}/get_loads", timeout=10).json()["loads"]
    seen = {load["worker"]: load for load in smg_loads}
    for server in replicas.servers:
        (rill,) = requests.get(f"{server.url}/v1/loads", timeout=10).json()["loads"]
        assert seen[server.url]["max_total_num_tokens"] == rill["max_total_num_tokens"] > 0
        # 8: the replicas' --max-batch-size.
        assert seen[server.url]["max_running_requests"] == rill["max_running_requests"] == 8


def hit_rate(replicas: Replicas, gateway: Gateway, seed: int, groups: int = 5, rounds: int = 4) -> float:
    """Prefix-cache hits / prompt tokens looked up, over both replicas, for `groups` long prefixes (new to
    the replicas) each asked `rounds` questions, the groups interleaved: g0 g1 .. g4 g0 g1 ..."""
    prefixes = [words(seed=seed * 100 + group, count=250) + "\n" for group in range(groups)]
    before = replicas.counters()
    for round_ in range(rounds):
        for prefix in prefixes:
            gateway.complete(prefix + f"Question {round_}: what is next?", max_tokens=1)
    after = replicas.counters()
    hit = sum(a["hit"] - b["hit"] for a, b in zip(after, before, strict=True))
    queried = sum(a["queried"] - b["queried"] for a, b in zip(after, before, strict=True))
    return hit / queried


def test_cache_aware_hits_more_than_round_robin(
    replicas: Replicas, gateway: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    cache_aware = hit_rate(replicas, gateway, seed=3)
    with smg(replicas, "round_robin", tmp_path_factory.mktemp("smg_rr")) as round_robin_gateway:
        round_robin = hit_rate(replicas, round_robin_gateway, seed=4)
    print(f"prefix-cache hit rate: cache_aware {cache_aware:.3f}, round_robin {round_robin:.3f}")
    # Round robin sends each group to both replicas (5 groups, 2 replicas), so each prefix is computed
    # twice; cache-aware routing computes it once.
    assert cache_aware > round_robin + 0.1, (cache_aware, round_robin)
