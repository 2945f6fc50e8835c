"""The shard server as a real subprocess on a unix socket, driven through the generated gRPC stubs."""

from __future__ import annotations

import asyncio
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import grpc
import pytest
from rill.shard.pb.shard.v1 import shard_pb2, shard_pb2_grpc
from rill.shard.server import ModelThread

from bench.servers import spawn, wait_until

from .conftest import save_tiny_model
from .test_runner import hf_greedy

BLOCK_SIZE = 4


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = save_tiny_model(tmp_path_factory.mktemp("server-model"), eos_token_id=[2, 7])
    (path / "generation_config.json").write_text('{"eos_token_id": [7, 9]}')
    return path


@contextmanager
def shard_server(model_dir: Path, socket_path: Path, *flags: str) -> Iterator[shard_pb2_grpc.ShardStub]:
    """`python -m rill.shard.server` on `socket_path` (one thread, BLOCK_SIZE blocks, `flags`) until the
    block ends; it must then exit 0 and remove its socket."""
    log_path = socket_path.with_suffix(".log")
    command = [
        sys.executable, "-m", "rill.shard.server",
        "--model-id", str(model_dir),
        "--socket", str(socket_path),
        "--kv-block-size", str(BLOCK_SIZE),
        "--num-threads", "1",
        *flags,
    ]  # fmt: skip
    process = spawn(command, log_path)
    channel = grpc.insecure_channel(f"unix://{socket_path}")
    try:
        wait_until(socket_path.exists, process, "shard", log_path, timeout_s=60, poll_s=0.1)
        grpc.channel_ready_future(channel).result(timeout=30)
        yield shard_pb2_grpc.ShardStub(channel)
    finally:
        channel.close()
        process.terminate()
        process.wait(timeout=30)
    assert process.returncode == 0, log_path.read_text()
    assert not socket_path.exists()


@pytest.fixture(scope="module")
def stub(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[shard_pb2_grpc.ShardStub]:
    with shard_server(model_dir, tmp_path_factory.mktemp("sock") / "shard.sock") as server:
        yield server


def forward_request(
    seq_id: int, token_ids: list[int], num_computed_tokens: int, with_params: bool = False, **fields: object
) -> shard_pb2.ForwardRequest:
    num_blocks = -(-(num_computed_tokens + len(token_ids)) // BLOCK_SIZE)
    chunk = shard_pb2.SequenceChunk(
        id=seq_id,
        token_ids=token_ids,
        num_computed_tokens=num_computed_tokens,
        block_table=list(range(1 + 10 * seq_id, 1 + 10 * seq_id + num_blocks)),
        sample=True,
    )
    if with_params:
        chunk.params.CopyFrom(shard_pb2.SamplingParams(do_sample=False))
    return shard_pb2.ForwardRequest(sequences=[chunk], **fields)


def test_info_health_warmup_and_greedy_decode(stub: shard_pb2_grpc.ShardStub, model_dir: Path) -> None:
    info = stub.Info(shard_pb2.InfoRequest())
    assert (info.model_type, info.dtype, info.device) == ("llama", "float32", "cpu")
    assert (info.block_size, info.vocab_size, info.max_position_embeddings, info.world_size) == (
        4,
        300,
        512,
        1,
    )
    assert list(info.eos_token_ids) == [2, 7, 9]
    stub.Health(shard_pb2.HealthRequest())
    with pytest.raises(grpc.RpcError) as error:
        stub.Prefill(forward_request(0, [1, 2], 0, with_params=True))
    assert error.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    warmup = stub.Warmup(
        shard_pb2.WarmupRequest(max_batch_tokens=32, max_batch_size=4, max_total_kv_tokens=400)
    )
    assert warmup.num_blocks == 101

    prompt, num_new_tokens = [3, 141, 59, 26, 53, 58, 97, 1], 6
    response = stub.Prefill(forward_request(1, prompt, 0, with_params=True))
    assert response.forward_time_us > 0
    tokens = [response.generations[0].token_id]
    assert response.generations[0].id == 1 and response.generations[0].logprob <= 0
    for step in range(num_new_tokens - 1):
        response = stub.Decode(forward_request(1, tokens[-1:], len(prompt) + step))
        tokens.append(response.generations[0].token_id)
    assert tokens == hf_greedy(model_dir, prompt, num_new_tokens)

    stub.Decode(forward_request(1, tokens[-1:], len(prompt) + num_new_tokens - 1, released_ids=[7]))
    stub.ClearCache(shard_pb2.ClearCacheRequest())


def test_bad_input_is_invalid_argument_and_server_keeps_serving(stub: shard_pb2_grpc.ShardStub) -> None:
    stub.Warmup(shard_pb2.WarmupRequest(max_batch_tokens=32, max_batch_size=4, max_total_kv_tokens=400))
    bad_requests = {
        "out of range": forward_request(2, [1, 300], 0, with_params=True),
        "params missing": forward_request(3, [1, 2], 0),
        "exactly one token": forward_request(2, [1, 2], 0, with_params=True),
    }
    for message, request in bad_requests.items():
        call = stub.Decode if message == "exactly one token" else stub.Prefill
        with pytest.raises(grpc.RpcError) as error:
            call(request)
        assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert message in error.value.details()
    response = stub.Prefill(forward_request(2, [1, 2, 3], 0, with_params=True))
    assert len(response.generations) == 1
    stub.Health(shard_pb2.HealthRequest())


def test_penalties_bias_cached_tokens_and_top_logprobs(
    stub: shard_pb2_grpc.ShardStub, model_dir: Path
) -> None:
    stub.Warmup(shard_pb2.WarmupRequest(max_batch_tokens=32, max_batch_size=4, max_total_kv_tokens=400))
    prompt = [3, 141, 59, 26, 53, 58, 97, 1]
    plain = hf_greedy(model_dir, prompt, 1)[0]
    params = shard_pb2.SamplingParams(
        do_sample=False,
        repetition_penalty=1.5,
        frequency_penalty=0.5,
        presence_penalty=-0.25,
        logit_bias={plain: -100.0},
        top_n_logprobs=4,
        num_prompt_tokens=len(prompt),
        min_new_tokens=1,
        stop_token_ids=[7, 9],
    )

    def prefill(seq_id: int, num_computed_tokens: int, block_table: list[int], **fields: object) -> object:
        seq = shard_pb2.SequenceChunk(
            id=seq_id,
            token_ids=prompt[num_computed_tokens:],
            num_computed_tokens=num_computed_tokens,
            block_table=block_table,
            sample=True,
            params=params,
            **fields,
        )
        return stub.Prefill(shard_pb2.ForwardRequest(sequences=[seq])).generations[0]

    full = prefill(4, 0, [61, 62])
    assert full.token_id not in (plain, 7, 9)
    # Alternatives come from the raw distribution, in which the biased-away greedy token is the top one.
    assert len(full.top_logprobs) == 4 and full.top_logprobs[0].token_id == plain
    top = [t.logprob for t in full.top_logprobs]
    assert top == sorted(top, reverse=True) and full.logprob <= top[0] <= 0
    # A prefix hit on the first block: the history before it comes as cached_token_ids.
    hit = prefill(5, 4, [61, 71], cached_token_ids=prompt[:4])
    assert (hit.token_id, hit.logprob, list(hit.top_logprobs)) == (
        full.token_id,
        full.logprob,
        list(full.top_logprobs),
    )
    step = shard_pb2.SequenceChunk(
        id=5, token_ids=[hit.token_id], num_computed_tokens=len(prompt), block_table=[61, 71, 72], sample=True
    )
    decode = stub.Decode(shard_pb2.ForwardRequest(released_ids=[4], sequences=[step]))
    assert len(decode.generations[0].top_logprobs) == 4

    params.top_n_logprobs = 21
    with pytest.raises(grpc.RpcError) as error:
        prefill(6, 0, [81, 82])
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "top_n_logprobs" in error.value.details()


def test_the_model_thread_runs_every_call_on_one_thread_off_the_event_loop() -> None:
    """One OpenMP team per process: loading, warmup and every forward run on the same thread."""

    async def idents() -> tuple[set[int], int]:
        model_thread = ModelThread()
        seen = {await model_thread.run(threading.get_ident) for _ in range(5)}
        seen |= set(await asyncio.gather(*(model_thread.run(threading.get_ident) for _ in range(5))))
        return seen, threading.get_ident()

    seen, loop_thread = asyncio.run(idents())
    assert len(seen) == 1 and loop_thread not in seen
