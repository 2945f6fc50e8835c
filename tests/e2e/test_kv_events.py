"""End to end: KV-cache events (`--kv-events-endpoint`) as a gateway's indexer receives them. A pyzmq SUB
socket (libzmq, as vLLM's own subscribers use) follows a real `python -m rill` with a small KV pool and checks
the stream against the server: every message is [topic, 8-byte sequence number, msgpack batch] with
consecutive sequence numbers, decodes with vLLM's event structs (msgspec, typed), `BlockStored` carries a
prompt's tokens block by block (as /tokenize gives them) with parents chaining, a salt shows in block 0's
extra keys, eviction sends `BlockRemoved` for stored leaves, a shard restart sends `AllBlocksCleared`, and
the blocks the stream says are cached are exactly as many as the router's prefix cache holds."""

from __future__ import annotations

import itertools
import os
import re
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgpack
import msgspec
import pytest
import requests
import zmq

from bench.servers import free_port

from .conftest import Server, start_server, stop_server

BLOCK_SIZE = 16
# 64 blocks: a few prompts of ~10 blocks fill it, so eviction is reached quickly.
KV_TOKENS = 1024


# vLLM's event structs (vllm/distributed/kv_events.py, v0.26 and later): the batch positional, each event a
# map tagged by "type". Decoding with them checks field names and types the way vLLM's own subscribers do.
class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


DECODER = msgspec.msgpack.Decoder(KVEventBatch)


@dataclass
class Block:
    parent: int | None
    token_ids: list[int]


@dataclass
class CacheView:
    """The replica's prefix cache as a subscriber rebuilds it from the stream, checking each event against
    what it already knows."""

    blocks: dict[int, Block] = field(default_factory=dict)
    events: list[KVCacheEvent] = field(default_factory=list)

    def apply(self, event: KVCacheEvent) -> None:
        self.events.append(event)
        if isinstance(event, BlockStored):
            assert event.block_size == BLOCK_SIZE and event.medium == "GPU", event
            assert len(event.token_ids) == BLOCK_SIZE * len(event.block_hashes), event
            assert event.parent_block_hash is None or event.parent_block_hash in self.blocks, event
            parent = event.parent_block_hash
            for i, block_hash in enumerate(event.block_hashes):
                assert block_hash != 0 and block_hash not in self.blocks, event
                self.blocks[block_hash] = Block(
                    parent, event.token_ids[i * BLOCK_SIZE : (i + 1) * BLOCK_SIZE]
                )
                parent = block_hash
        elif isinstance(event, BlockRemoved):
            for block_hash in event.block_hashes:
                assert block_hash in self.blocks, f"removed a block never stored: {event}"
                children = [h for h, block in self.blocks.items() if block.parent == block_hash]
                assert not children, f"removed {block_hash} before its children {children}"
                del self.blocks[block_hash]
        else:
            self.blocks.clear()

    def chain(self, token_ids: list[int]) -> list[int]:
        """The cached blocks holding `token_ids`' full blocks, in order, as far as they are cached."""
        hashes: list[int] = []
        parent = None
        for start in range(0, len(token_ids) - BLOCK_SIZE + 1, BLOCK_SIZE):
            chunk = token_ids[start : start + BLOCK_SIZE]
            found = [h for h, b in self.blocks.items() if b.parent == parent and b.token_ids == chunk]
            if not found:
                break
            assert len(found) == 1, f"two cached blocks for one prefix: {found}"
            parent = found[0]
            hashes.append(parent)
        return hashes


class Subscriber:
    """A SUB socket on the router's events endpoint, subscribed to llm-d's topic prefix `kv@`."""

    def __init__(self, endpoint: str) -> None:
        self.context = zmq.Context()
        self.socket = self.context.socket(zmq.SUB)
        self.socket.setsockopt(zmq.SUBSCRIBE, b"kv@")
        self.socket.connect(endpoint)
        self.topics: set[bytes] = set()
        self.last_sequence: int | None = None
        self.view = CacheView()

    def receive(self, timeout_s: float) -> bool:
        """Applies the next message's events; False if none came within `timeout_s`."""
        if not self.socket.poll(int(timeout_s * 1000)):
            return False
        frames = self.socket.recv_multipart()
        assert len(frames) == 3, frames
        topic, sequence_bytes, payload = frames
        assert len(sequence_bytes) == 8
        sequence = int.from_bytes(sequence_bytes, "big")
        if self.last_sequence is not None:
            assert sequence == self.last_sequence + 1, f"sequence {sequence} after {self.last_sequence}"
        self.last_sequence = sequence
        self.topics.add(topic)
        # llm-d decodes the batch as exactly three positional fields.
        raw = msgpack.unpackb(payload)
        assert isinstance(raw, list) and len(raw) == 3 and raw[2] == 0, raw
        batch = DECODER.decode(payload)
        assert abs(batch.ts - time.time()) < 60, batch.ts
        for event in batch.events:
            self.view.apply(event)
        return True

    def receive_until(self, condition: Callable[[], bool], timeout_s: float = 20.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not condition():
            assert time.monotonic() < deadline, f"timed out; last events: {self.view.events[-5:]}"
            self.receive(0.2)

    def close(self) -> None:
        self.socket.close(linger=0)
        self.context.term()


@dataclass
class EventsServer:
    server: Server
    subscriber: Subscriber
    endpoint_port: int


@pytest.fixture(scope="module")
def events_server(default_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[EventsServer]:
    port = free_port()
    server = start_server(
        default_model, tmp_path_factory.mktemp("kv-events"),
        "--kv-events-endpoint", f"tcp://*:{port}", "--max-batch-tokens", "256",
        "--max-batch-total-tokens", str(KV_TOKENS), "--max-input-tokens", "512", "--max-total-tokens", "600",
        "--restart-shards",
    )  # fmt: skip
    subscriber = Subscriber(f"tcp://127.0.0.1:{port}")
    try:
        # A PUB socket sends only to subscriptions it already knows: wait until one of our requests shows.
        for attempt in range(20):
            generate(server, f"Warming up the subscription, attempt {attempt}: " + "one two three " * 8)
            if subscriber.receive(1.0):
                break
        else:
            raise AssertionError("no KV-cache event reached the subscriber")
        yield EventsServer(server, subscriber, port)
    finally:
        subscriber.close()
        stop_server(server)
    assert server.process.returncode == 0, server.log_path.read_text()[-3000:]


def generate(server: Server, prompt: str, **parameters: Any) -> None:
    body = {"inputs": prompt, "parameters": {"max_new_tokens": 1, **parameters}}
    response = requests.post(f"{server.url}/generate", json=body, timeout=120)
    assert response.status_code == 200, response.text


def tokenize(server: Server, prompt: str) -> list[int]:
    response = requests.post(f"{server.url}/tokenize", json={"prompt": prompt}, timeout=30)
    assert response.status_code == 200, response.text
    return [token["id"] for token in response.json()["tokens"]]


def prompt(topic: str, num_words: int = 40) -> str:
    return f"Notes on {topic}: " + " ".join(f"{topic}-{i}" for i in range(num_words))


def assert_view_matches_server(events: EventsServer) -> None:
    """Once the server is idle, the stream's cache holds exactly the router's prefix-cache blocks."""
    num_blocks = events.server.wait_idle()["kv"]["prefix_cache_blocks"]
    events.subscriber.receive_until(lambda: len(events.subscriber.view.blocks) == num_blocks)
    while events.subscriber.receive(0.5):  # nothing more may come and change it
        pass
    assert len(events.subscriber.view.blocks) == num_blocks


def test_stored_blocks_carry_the_prompt_tokens_block_by_block(events_server: EventsServer) -> None:
    server, subscriber = events_server.server, events_server.subscriber
    text = prompt("rivers")
    token_ids = tokenize(server, text)
    num_full_blocks = len(token_ids) // BLOCK_SIZE
    assert num_full_blocks >= 8
    generate(server, text)
    subscriber.receive_until(lambda: len(subscriber.view.chain(token_ids)) == num_full_blocks)
    chain = subscriber.view.chain(token_ids)
    assert subscriber.view.blocks[chain[0]].parent is None
    for parent, child in itertools.pairwise(chain):
        assert subscriber.view.blocks[child].parent == parent
    # llm-d's topic: kv@<pod>@<model>, by default the router's address and served model name.
    port, model = server.url.rsplit(":", 1)[1], server.info()["served_model_name"]
    assert subscriber.topics == {f"kv@127.0.0.1:{port}@{model}".encode()}

    # The same prompt under a salt: other blocks and hashes, the salt's namespace in block 0's extra keys.
    generate(server, text, cache_salt="tenant-a")
    salted: list[BlockStored] = []

    def salted_chain_stored() -> bool:
        salted[:] = [e for e in subscriber.view.events if isinstance(e, BlockStored) and e.extra_keys]
        return sum(len(e.block_hashes) for e in salted) == num_full_blocks

    subscriber.receive_until(salted_chain_stored)
    first = salted[0]
    assert first.parent_block_hash is None and first.token_ids[:BLOCK_SIZE] == token_ids[:BLOCK_SIZE]
    assert first.extra_keys is not None and len(first.extra_keys) == len(first.block_hashes)
    (salt_key,) = first.extra_keys[0] or ()
    assert re.fullmatch(r"[0-9a-f]{16}", salt_key), first.extra_keys
    assert all(key is None for key in first.extra_keys[1:])
    assert not set(first.block_hashes) & set(chain)
    assert_view_matches_server(events_server)


def count_removed(subscriber: Subscriber) -> int:
    return sum(isinstance(e, BlockRemoved) for e in subscriber.view.events)


def test_eviction_removes_stored_leaves_before_their_blocks_are_reused(events_server: EventsServer) -> None:
    server, subscriber = events_server.server, events_server.subscriber
    num_removed_before = count_removed(subscriber)
    num_usable_blocks = server.info()["kv"]["total_blocks"]
    # Distinct prompts of ~10 blocks each: more than the pool holds, so older ones are evicted.
    texts = [prompt(f"topic{i}", 38) for i in range(num_usable_blocks // 8 + 2)]
    for text in texts:
        generate(server, text)
    subscriber.receive_until(lambda: count_removed(subscriber) > num_removed_before)
    assert_view_matches_server(events_server)
    # The latest prompt is cached whole; the first one has lost blocks to eviction.
    last = tokenize(server, texts[-1])
    assert len(subscriber.view.chain(last)) == len(last) // BLOCK_SIZE
    first = tokenize(server, texts[0])
    assert len(subscriber.view.chain(first)) < len(first) // BLOCK_SIZE


def test_a_shard_restart_clears_all_blocks(events_server: EventsServer) -> None:
    server, subscriber = events_server.server, events_server.subscriber
    assert subscriber.view.blocks, "earlier tests cached blocks"
    pids = [int(p) for p in re.findall(r"shard-0 has pid (\d+)", server.log_path.read_text())]
    num_events = len(subscriber.view.events)
    # Killed under a request, as in test_restart.py: the failed step makes the router wait for the shards,
    # warm them up and start over with an empty pool.
    body = {"inputs": prompt("in flight"), "parameters": {"max_new_tokens": 200}}
    in_flight = threading.Thread(
        target=lambda: requests.post(f"{server.url}/generate", json=body, timeout=120), daemon=True
    )
    in_flight.start()
    time.sleep(1.5)
    os.kill(pids[-1], signal.SIGKILL)
    in_flight.join(60)
    deadline = time.monotonic() + 180
    while requests.get(f"{server.url}/ready", timeout=5).status_code != 200:
        assert server.process.poll() is None, server.log_path.read_text()[-3000:]
        assert time.monotonic() < deadline, "the shard did not come back"
        time.sleep(1)
    subscriber.receive_until(
        lambda: any(isinstance(e, AllBlocksCleared) for e in subscriber.view.events[num_events:])
    )
    assert not subscriber.view.blocks
    text = prompt("after the restart")
    generate(server, text)
    token_ids = tokenize(server, text)
    subscriber.receive_until(lambda: len(subscriber.view.chain(token_ids)) == len(token_ids) // BLOCK_SIZE)
    assert_view_matches_server(events_server)
