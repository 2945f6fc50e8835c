"""Speculative verification (`SequenceChunk.num_speculative_tokens` = k): the k + 1 Generations of one chunk
are bitwise, in float32, what k + 1 single-token decode calls give when fed the same tokens, whatever shares
the batch; a rolled-back sequence continues as one that never saw the rejected proposals; bad combinations
are refused naming the field.

The oracle decodes each sequence alone, one token per call, feeding at each step either the token it just
got (a right proposal) or another one (a wrong proposal); the proposals it fed are then verified in one
chunk, in a batch with other speculating sequences, plain decodes and a prefill chunk. The last test does
the same through the real gRPC server.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest
from rill.shard.batch import ForwardRequest, Generation, SequenceChunk
from rill.shard.pb.shard.v1 import shard_pb2
from rill.shard.runner import ModelRunner
from rill.shard.sampling import SamplingParams

from .conftest import GREEDY, chunk, make_runner
from .test_server import BLOCK_SIZE, shard_server

BLOCKS_PER_SEQUENCE = 12  # 48 tokens of block size 4: room for every prompt below plus its proposals
VOCAB_SIZE = 300  # conftest.TINY


@pytest.fixture(scope="module", params=["cpu", "torch"])
def runner(request: pytest.FixtureRequest, llama_dir: Path) -> ModelRunner:
    """The tiny Llama on the CPU kernels (its fused decoder stack included), then on the torch references;
    runners of this module's own, so its sequence ids meet no other test's."""
    return make_runner(llama_dir, attention_backend=request.param)


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    prompt: list[int]
    params: SamplingParams
    num_speculative_tokens: int
    num_right: int  # the first num_right proposals are the tokens sampled at their positions, the rest not
    num_real: int = 1  # tokens of the verification chunk before the proposals (more: a recomputed tail)


def prompt(seed: int, length: int) -> list[int]:
    return [(seed * 37 + 11 * i + i * i) % VOCAB_SIZE for i in range(length)]


SAMPLED = SamplingParams(do_sample=True, temperature=0.8, top_k=40, top_p=0.9, seed=1234)
PENALIZED = dataclasses.replace(
    SAMPLED,
    seed=77,
    repetition_penalty=1.8,
    frequency_penalty=1.2,
    presence_penalty=0.7,
    num_prompt_tokens=20,
)
# Generated-token counting starts 2 tokens before the verification chunk's first generated position, so with
# min_new_tokens 4 the stop ids are masked at the chunk's first 2 rows and allowed from its third on.
STOPS = range(0, VOCAB_SIZE, 2)
MIN_NEW = SamplingParams(num_prompt_tokens=17, min_new_tokens=4, stop_token_ids=tuple(STOPS))


PREFILL_PROMPT = prompt(11, 12)


def cases() -> list[Case]:
    return [
        Case("greedy k=1, right", prompt(1, 13), GREEDY, 1, num_right=1),
        Case("greedy k=5, 2 right", prompt(2, 21), GREEDY, 5, num_right=2),
        Case("sampled k=3, wrong", prompt(3, 9), SAMPLED, 3, num_right=0),
        Case("sampled k=5, all right", prompt(4, 17), dataclasses.replace(SAMPLED, seed=99), 5, num_right=5),
        Case("penalties, sampled k=4, 1 right", prompt(5, 22), PENALIZED, 4, num_right=1),
        Case(
            "penalties, greedy k=4, 3 right",
            prompt(6, 22),
            dataclasses.replace(PENALIZED, do_sample=False),
            4,
            num_right=3,
        ),
        Case("min_new_tokens + stops k=4", prompt(7, 19), MIN_NEW, 4, num_right=2),
        Case(
            "top_n_logprobs k=2, 3 real tokens",
            prompt(8, 15),
            dataclasses.replace(SAMPLED, seed=5, top_n_logprobs=5),
            2,
            num_right=1,
            num_real=3,
        ),
        Case("plain greedy decode", prompt(9, 11), dataclasses.replace(GREEDY, top_n_logprobs=3), 0, 0),
        Case("plain sampled decode with penalties", prompt(10, 23), PENALIZED, 0, 0),
    ]


def run(runner: ModelRunner, *sequences: SequenceChunk) -> list[Generation]:
    return runner.forward(ForwardRequest(sequences=list(sequences))).generations


def other_token(token_id: int) -> int:
    return (token_id + 1) % VOCAB_SIZE


def decode_sequentially(
    runner: ModelRunner, seq_id: int, first_block: int, case: Case
) -> tuple[list[int], list[Generation]]:
    """The oracle, alone in each call: prefills the prompt but its last token, then decodes one token per
    call k + 1 times, feeding the prompt's last token, then k proposals (right ones first). Returns the
    proposals it fed and the k + 1 Generations."""
    num_prompt_tokens = len(case.prompt)
    run(runner, chunk(seq_id, case.prompt[:-1], 0, first_block, sample=False, params=case.params))
    fed, proposals, generations = case.prompt[-1], [], []
    for i in range(case.num_speculative_tokens + 1):
        (generation,) = run(runner, chunk(seq_id, [fed], num_prompt_tokens - 1 + i, first_block, params=None))
        generations.append(generation)
        fed = generation.token_id if i < case.num_right else other_token(generation.token_id)
        proposals.append(fed)
    return proposals[:-1], generations


def verification_chunk(seq_id: int, first_block: int, case: Case, proposals: list[int]) -> SequenceChunk:
    num_computed_tokens = len(case.prompt) - case.num_real
    return dataclasses.replace(
        chunk(
            seq_id,
            case.prompt[num_computed_tokens:] + proposals,
            num_computed_tokens,
            first_block,
            params=None,
        ),
        num_speculative_tokens=case.num_speculative_tokens,
    )


def test_verification_equals_sequential_decoding_bitwise(runner: ModelRunner) -> None:
    all_cases = cases()
    oracle_id, oracle_block = 900, 1 + BLOCKS_PER_SEQUENCE * len(all_cases)
    expected: dict[str, list[Generation]] = {}
    proposals: dict[str, list[int]] = {}
    for i, case in enumerate(all_cases):
        proposals[case.name], oracle = decode_sequentially(runner, oracle_id, oracle_block, case)
        expected[case.name] = [dataclasses.replace(g, id=i) for g in oracle]
    first_blocks = [1 + BLOCKS_PER_SEQUENCE * i for i in range(len(all_cases))]
    prefill_id = len(all_cases)
    run(
        runner,
        *[
            chunk(
                i,
                case.prompt[: len(case.prompt) - case.num_real],
                0,
                first_block,
                sample=False,
                params=case.params,
            )
            for i, (case, first_block) in enumerate(zip(all_cases, first_blocks, strict=True))
        ],
        chunk(prefill_id, PREFILL_PROMPT[:5], 0, oracle_block, sample=False, params=SAMPLED),
    )
    # One call: every verification chunk, and the middle chunk of a prompt (no Generation) in their midst.
    verifications = [
        verification_chunk(i, first_block, case, proposals[case.name])
        for i, (case, first_block) in enumerate(zip(all_cases, first_blocks, strict=True))
    ]
    mid_prefill = chunk(prefill_id, PREFILL_PROMPT[5:], 5, oracle_block, sample=False, params=None)
    generations = run(runner, *verifications[:3], mid_prefill, *verifications[3:])
    assert [g.id for g in generations] == [
        i for i, case in enumerate(all_cases) for _ in range(case.num_speculative_tokens + 1)
    ]
    start = 0
    for case in all_cases:
        got = generations[start : start + case.num_speculative_tokens + 1]
        start += len(got)
        assert got == expected[case.name], case.name
        if case.params.top_n_logprobs:
            assert all(len(g.top_logprobs) == case.params.top_n_logprobs for g in got), case.name
    # The test's premises: proposals were checked where they agree and where they do not, and the
    # min_new_tokens boundary fell inside the window (stop ids masked at its first rows, one chosen after).
    for case in all_cases:
        sampled = [g.token_id for g in expected[case.name][:-1]]
        agree = [p == t for p, t in zip(proposals[case.name], sampled, strict=True)]
        assert agree == [i < case.num_right for i in range(case.num_speculative_tokens)], case.name
    min_new = [g.token_id for g in expected["min_new_tokens + stops k=4"]]
    assert all(t not in STOPS for t in min_new[:2]) and any(t in STOPS for t in min_new[2:]), min_new


@pytest.mark.parametrize("params", [PENALIZED, dataclasses.replace(PENALIZED, do_sample=False)])
def test_rollback_continues_as_if_rejected_tokens_were_never_seen(
    runner: ModelRunner, params: SamplingParams
) -> None:
    """A verification of 4 proposals that rejects the second; the next chunk, at the accepted point and itself
    speculating, gives what a sequence that only ever saw the accepted tokens gives. The rejected proposals
    are that continuation's own tokens, so a stale history would penalize exactly the tokens it picks."""
    prompt_ids = prompt(12, 22)
    (right,), (_, rejecting) = decode_sequentially(
        runner, 901, 1 + BLOCKS_PER_SEQUENCE, Case("", prompt_ids, params, 1, 1)
    )
    accepted = [*prompt_ids, right, rejecting.token_id]
    continued = Case("continued", accepted, params, 2, num_right=2)
    continuation, expected = decode_sequentially(runner, 902, 1 + 2 * BLOCKS_PER_SEQUENCE, continued)
    rejected = [*continuation, expected[-1].token_id]
    assert rejected[0] != rejecting.token_id  # the premise: the second proposal is rejected
    run(runner, chunk(1, prompt_ids[:-1], 0, 1, sample=False, params=params))
    verification = Case("verified", prompt_ids, params, 4, num_right=1)
    verified = run(runner, verification_chunk(1, 1, verification, [right, *rejected]))
    assert [g.token_id for g in verified[:2]] == [right, rejecting.token_id]
    rolled_back = run(runner, verification_chunk(1, 1, continued, continuation))
    assert rolled_back == [dataclasses.replace(g, id=1) for g in expected]
    if params.needs_history:
        assert runner.history.get(1) == accepted + continuation


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (dict(sample=False), "num_speculative_tokens 2 sent without sample"),
        (
            dict(num_speculative_tokens=3),
            r"num_speculative_tokens 3 out of range \[0, len\(token_ids\) = 3\)",
        ),
        (dict(num_speculative_tokens=-1), r"num_speculative_tokens -1 out of range"),
        (
            dict(allowed_token_bitmask=[0xFFFFFFFF] * 10),
            "num_speculative_tokens 2 sent with allowed_token_bitmask",
        ),
    ],
)
def test_bad_speculation_is_refused_naming_the_field(
    runner: ModelRunner, fields: dict[str, object], message: str
) -> None:
    good = dataclasses.replace(chunk(20, [1, 2, 3], 0, 1), num_speculative_tokens=2)
    assert len(run(runner, good)) == 3
    with pytest.raises(ValueError, match=f"sequence 21: {message}"):
        run(runner, chunk(22, [4], 0, 5), dataclasses.replace(good, id=21, **fields))
    assert 22 not in runner.params_by_id  # refused before anything changed


def pb_chunk(
    seq_id: int, token_ids: list[int], num_computed_tokens: int, **fields: object
) -> shard_pb2.SequenceChunk:
    num_blocks = -(-(num_computed_tokens + len(token_ids)) // BLOCK_SIZE)
    first_block = 1 + BLOCKS_PER_SEQUENCE * seq_id
    return shard_pb2.SequenceChunk(
        id=seq_id,
        token_ids=token_ids,
        num_computed_tokens=num_computed_tokens,
        block_table=list(range(first_block, first_block + num_blocks)),
        **fields,
    )


def test_grpc_verification_equals_decode_calls_and_bad_speculation_is_invalid_argument(
    llama_dir: Path, tmp_path: Path
) -> None:
    """Through the real server: Prefill with num_speculative_tokens 2 answers what 3 Decode calls answer,
    and a speculating chunk under a grammar is INVALID_ARGUMENT naming the field (the server carries on)."""
    params = shard_pb2.SamplingParams(
        do_sample=True,
        temperature=0.9,
        top_k=30,
        top_p=1.0,
        seed=42,
        repetition_penalty=1.5,
        top_n_logprobs=3,
    )
    prompt_ids = prompt(13, 14)
    num_prompt_tokens = len(prompt_ids)
    with shard_server(llama_dir, tmp_path / "shard.sock") as stub:
        stub.Warmup(shard_pb2.WarmupRequest(max_batch_tokens=32, max_batch_size=4, max_total_kv_tokens=400))

        def call(
            method: Callable[..., shard_pb2.ForwardResponse], *sequences: shard_pb2.SequenceChunk
        ) -> list[shard_pb2.Generation]:
            return list(method(shard_pb2.ForwardRequest(sequences=sequences)).generations)

        call(stub.Prefill, pb_chunk(2, prompt_ids[:-1], 0, params=params))
        fed, expected = [prompt_ids[-1]], []
        for i in range(3):
            (generation,) = call(stub.Decode, pb_chunk(2, fed[-1:], num_prompt_tokens - 1 + i, sample=True))
            generation.id = 1  # as the verified sequence's
            expected.append(generation)
            fed.append(generation.token_id if i == 0 else other_token(generation.token_id))
        call(stub.Prefill, pb_chunk(1, prompt_ids[:-1], 0, params=params))
        verification = pb_chunk(1, fed[:3], num_prompt_tokens - 1, sample=True, num_speculative_tokens=2)
        assert call(stub.Prefill, verification) == expected
        assert all(len(g.top_logprobs) == 3 for g in expected)
        constrained = pb_chunk(
            3,
            prompt_ids,
            0,
            sample=True,
            params=params,
            num_speculative_tokens=1,
            allowed_token_bitmask=[1] * 10,
        )
        with pytest.raises(grpc.RpcError) as error:
            call(stub.Prefill, constrained)
        assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "num_speculative_tokens 1 sent with allowed_token_bitmask" in error.value.details()
        stub.Health(shard_pb2.HealthRequest())
