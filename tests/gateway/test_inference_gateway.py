"""Two Rill replicas behind the real Kubernetes inference gateway (tests/gateway/conftest.py: kube-apiserver,
the InferencePool, the endpoint picker configured by deploy/inference-gateway/epp-config.yaml, Envoy): every
request is served and streams pass through; requests that share a long prefix land on the replica that holds
it (measured against the best possible and against Envoy's round robin on the same workload); new prefixes go
to the idle replica while the other is loaded; after a replica is killed and its Pod marked not ready, nothing
sent is lost.

The tests run in file order and share one gateway; the last one kills a replica.
"""

from __future__ import annotations

import json
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import requests

from tests.e2e.conftest import kill_instance
from tests.gateway.conftest import MODEL, Gateway, Replica

# The prefix workload: GROUPS long prefixes (prompts of about 410 tokens), REQUESTS_PER_GROUP requests
# each with its own short question, in one shuffled order, sent one at a time.
GROUPS = 4
REQUESTS_PER_GROUP = 6
PREFIX_WORDS = 400
WORDS = "river stone cloud market lantern orchard copper violin harbor meadow signal canyon glacier".split()


def complete(url: str, prompt: str, max_tokens: int = 1, stream: bool = False) -> requests.Response:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": stream}
    return requests.post(f"{url}/v1/completions", json=body, timeout=300, stream=stream)


def metric(replica: Replica, name: str) -> float:
    text = requests.get(f"{replica.server.url}/metrics", timeout=10).text
    samples = [line.rsplit(" ", 1) for line in text.splitlines() if not line.startswith("#")]
    return sum(float(value) for series, value in samples if series.split("{")[0] == name)


def prefix_counters(replicas: list[Replica]) -> tuple[float, float]:
    """(queried, hit) prompt tokens of the prefix caches, summed over the replicas."""
    queried = sum(metric(r, "rill_prefix_cache_queried_tokens_total") for r in replicas)
    hit = sum(metric(r, "rill_prefix_cache_hit_tokens_total") for r in replicas)
    return queried, hit


def prefix_workload(seed: int) -> list[tuple[int, str]]:
    """(group, prompt) pairs; each seed gives new prefixes, so no run finds another's in a cache."""
    rng = random.Random(seed)
    prefixes = [" ".join(rng.choice(WORDS) for _ in range(PREFIX_WORDS)) for _ in range(GROUPS)]
    prompts = [
        (group, f"{prefixes[group]}\nQuestion {index}: which word comes {index + 1} times?")
        for group in range(GROUPS)
        for index in range(REQUESTS_PER_GROUP)
    ]
    rng.shuffle(prompts)
    return prompts


@dataclass
class WorkloadRun:
    hit_rate: float  # prefix-cache hit tokens / queried tokens over both replicas
    hosts_by_group: dict[int, set[str]]


def run_prefix_workload(url: str, replicas: list[Replica], seed: int) -> WorkloadRun:
    queried_before, hit_before = prefix_counters(replicas)
    hosts_by_group: dict[int, set[str]] = {}
    for group, prompt in prefix_workload(seed):
        response = complete(url, prompt)
        assert response.status_code == 200, response.text
        hosts_by_group.setdefault(group, set()).add(response.headers.get("x-upstream-host", "direct"))
    queried_after, hit_after = prefix_counters(replicas)
    return WorkloadRun((hit_after - hit_before) / (queried_after - queried_before), hosts_by_group)


def test_requests_and_streams_pass_through(gateway: Gateway) -> None:
    addresses = {replica.address for replica in gateway.replicas}
    for index in range(4):
        response = complete(gateway.url, f"Request {index}: the capital of France is", max_tokens=4)
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["text"]
        assert response.headers["x-upstream-host"] in addresses

    arrivals: list[tuple[float, bytes]] = []
    with complete(gateway.url, "Count from one to twenty: one, two,", max_tokens=16, stream=True) as response:
        assert response.status_code == 200, response.text
        assert response.headers["content-type"].startswith("text/event-stream")
        for chunk in response.raw.stream(amt=65536, decode_content=True):  # each read as the socket gives it
            arrivals.append((time.monotonic(), chunk))
    text = b"".join(chunk for _, chunk in arrivals).decode()
    lines = [line for line in text.splitlines() if line.startswith("data:")]
    assert lines[-1] == "data: [DONE]"
    events = [json.loads(line.removeprefix("data:")) for line in lines[:-1]]
    assert "".join(event["choices"][0]["text"] for event in events)
    # Through Envoy and the EPP's streamed response processing the events come as they are made, not as one
    # body at the end: several reads, the first long before the last (a token takes tens of milliseconds).
    data_times = [at for at, chunk in arrivals if b"data:" in chunk]
    assert len(data_times) > 1, f"the stream arrived in {len(arrivals)} read(s): buffered on the way?"
    assert data_times[-1] - data_times[0] > 0.05


def test_shared_prefixes_land_on_the_replica_that_holds_them(gateway: Gateway) -> None:
    replicas = gateway.replicas
    # The best possible: every request on the replica that holds its prefix (one replica holds all of them).
    best = run_prefix_workload(replicas[0].server.url, replicas, seed=1)
    via_gateway = run_prefix_workload(gateway.url, replicas, seed=2)
    round_robin = run_prefix_workload(gateway.round_robin_url, replicas, seed=3)
    print(
        f"\nprefix-cache hit rate: best possible {best.hit_rate:.3f}, "
        f"via the gateway {via_gateway.hit_rate:.3f}, "
        f"round robin {round_robin.hit_rate:.3f}; replicas per group via the gateway: "
        f"{[len(hosts) for hosts in via_gateway.hosts_by_group.values()]}"
    )
    assert via_gateway.hit_rate >= 0.95 * best.hit_rate
    assert via_gateway.hit_rate > round_robin.hit_rate
    assert all(len(hosts) == 1 for hosts in via_gateway.hosts_by_group.values()), via_gateway.hosts_by_group


def test_new_prefixes_go_to_the_idle_replica(gateway: Gateway) -> None:
    loaded, idle = gateway.replicas
    # Long requests straight to one replica: 4 run (its --max-batch-size) and the rest wait in its queue.
    with ThreadPoolExecutor(8) as pool:
        prompts = [f"Load {index}: tell a long story." for index in range(8)]
        load = [pool.submit(complete, loaded.server.url, prompt, 160) for prompt in prompts]
        deadline = time.monotonic() + 60
        while metric(loaded, "rill_queue_depth") < 2:
            assert time.monotonic() < deadline, "the loaded replica's queue never grew"
            time.sleep(0.1)
        time.sleep(0.5)  # the EPP scrapes every 50 ms
        hosts = []
        for index in range(6):
            response = complete(gateway.url, f"New topic {index}: {' '.join(random.choices(WORDS, k=60))}")
            assert response.status_code == 200, response.text
            hosts.append(response.headers["x-upstream-host"])
        still_loaded = metric(loaded, "rill_queue_depth") + metric(loaded, "rill_running_sequences")
        assert still_loaded > 0, "the load ended before the requests were placed: the test proved nothing"
        for future in load:
            assert future.result().status_code == 200
    assert hosts == [idle.address] * len(hosts), hosts


def test_nothing_sent_after_the_readiness_flip_is_lost(gateway: Gateway) -> None:
    victim, survivor = gateway.replicas
    results: list[tuple[float, int, str]] = []  # (sent at, status, upstream)
    stop = threading.Event()

    def client(worker: int) -> None:
        index = 0
        while not stop.is_set():
            sent_at = time.monotonic()
            response = complete(gateway.url, f"Client {worker} request {index}: {random.choice(WORDS)}", 2)
            results.append((sent_at, response.status_code, response.headers.get("x-upstream-host", "")))
            index += 1

    threads = [threading.Thread(target=client, args=(worker,)) for worker in range(3)]
    for thread in threads:
        thread.start()
    try:
        time.sleep(3)
        assert {upstream for _, _, upstream in results} == {victim.address, survivor.address}, results
        kill_instance(victim.server)  # a crash
        # Its readiness probe fails: the kubelet marks the Pod not ready.
        gateway.kube.set_pod_ready(victim.pod, victim.host, is_ready=False)
        flipped_at = time.monotonic()
        time.sleep(5)
    finally:
        stop.set()
        for thread in threads:
            thread.join()
    after = [(status, upstream) for sent_at, status, upstream in results if sent_at > flipped_at]
    lost_before = sum(1 for sent_at, status, _ in results if sent_at <= flipped_at and status != 200)
    print(f"\nkilled a replica: {len(after)} requests sent after the flip, {lost_before} failed before it")
    assert len(after) >= 10
    assert after == [(200, survivor.address)] * len(after), after
