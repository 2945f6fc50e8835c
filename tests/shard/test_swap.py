"""The swap pool: blocks copied out to the host and back are bit-identical, and a sequence swapped out (its
device blocks overwritten meanwhile) and swapped back into other blocks continues with the same tokens."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from rill.kernels.cpu import CpuOps
from rill.shard.batch import BlockCopy, ForwardRequest
from rill.shard.config import ShardConfig
from rill.shard.kv_cache import KVCache
from rill.shard.runner import ModelRunner

from .conftest import chunk


@pytest.mark.parametrize(
    ("dtype", "block_size", "kernel_layout"),
    [(torch.float32, 4, False), (torch.bfloat16, 16, True)],  # the second: K in pairs where the CPU has bf16
)
def test_blocks_copied_out_and_back_are_bit_identical(dtype, block_size, kernel_layout) -> None:
    ops = CpuOps() if kernel_layout else None
    cache = KVCache(3, 9, block_size, 2, 8, dtype, torch.device("cpu"), ops=ops)
    cache.allocate_host_pool(6)
    assert cache.num_host_blocks == 6
    generator = torch.Generator().manual_seed(0)
    for pool in (*cache.k, *cache.v):
        pool.copy_(torch.randn(pool.shape, generator=generator).to(dtype))
    originals = [pool[[1, 2, 5]].clone() for pool in (*cache.k, *cache.v)]
    cache.swap_out([1, 2, 5], [4, 1, 3])
    for pool in (*cache.k, *cache.v):
        pool.zero_()  # the device blocks are reused while the sequence is swapped out
    cache.swap_in([4, 1, 3], [7, 8, 6])
    for original, pool in zip(originals, (*cache.k, *cache.v), strict=True):
        assert torch.equal(pool[[7, 8, 6]], original)
        assert not pool[[1, 2, 3, 4, 5]].any(), "only the named device blocks were written"


def test_bad_block_ids_are_refused() -> None:
    cache = KVCache(1, 4, 2, 1, 2, torch.float32, torch.device("cpu"))
    cache.allocate_host_pool(3)
    with pytest.raises(ValueError, match="device blocks"):
        cache.swap_out([0], [1])
    with pytest.raises(ValueError, match="host blocks"):
        cache.swap_in([3], [1])
    with pytest.raises(ValueError, match="length"):
        cache.swap_out([1, 2], [1])


def test_warmup_sizes_the_swap_pool_and_measures_costs(llama_dir: Path) -> None:
    runner = ModelRunner(
        ShardConfig(model_path=llama_dir, socket_path=llama_dir / "unused.sock", block_size=4)
    )
    bytes_per_block = runner._bytes_per_block()
    result = runner.warmup(64, 4, 1024, swap_space_bytes=10 * bytes_per_block + 1)
    assert result.num_host_blocks == 10 and runner.kv_cache.num_host_blocks == 10
    assert result.swap_seconds_per_block > 0 and result.prefill_seconds_per_token > 0
    assert runner.warmup(64, 4, 1024).num_host_blocks == 0


def test_a_swapped_sequence_continues_with_the_same_tokens(llama_dir: Path) -> None:
    runner = ModelRunner(
        ShardConfig(model_path=llama_dir, socket_path=llama_dir / "unused.sock", block_size=4)
    )
    runner.warmup(64, 4, 1024, swap_space_bytes=8 * runner._bytes_per_block())
    prompt = [5, 17, 3, 99, 42, 7, 1, 23, 64]

    def decode(first_block: int, num_steps: int, tokens: list[int]) -> list[int]:
        for _ in range(num_steps):
            request = ForwardRequest(
                sequences=[chunk(1, tokens[-1:], len(tokens) - 1, first_block, params=None)]
            )
            tokens.append(runner.forward(request).generations[0].token_id)
        return tokens

    # Without preemption: prompt in blocks 1.., then 6 decodes.
    tokens = prompt + [
        runner.forward(ForwardRequest(sequences=[chunk(1, prompt, 0, 1)])).generations[0].token_id
    ]
    expected = decode(1, 6, tokens)
    runner.forward(ForwardRequest(sequences=[chunk(2, [1], 0, 20)], released_ids=[1]))

    tokens = prompt + [
        runner.forward(ForwardRequest(sequences=[chunk(1, prompt, 0, 1)])).generations[0].token_id
    ]
    tokens = decode(1, 2, tokens)  # 12 tokens, the first 11 computed (in blocks 1..3)
    # Swap out blocks 1..3 while another sequence overwrites them in the same call.
    runner.forward(
        ForwardRequest(
            sequences=[chunk(3, list(range(100, 112)), 0, 1)],
            swap_out=[BlockCopy(1, 3), BlockCopy(2, 1), BlockCopy(3, 2)],
        )
    )
    # Swap into blocks 10..12 and carry on from there.
    request = ForwardRequest(
        sequences=[chunk(1, tokens[-1:], len(tokens) - 1, 10, params=None)],
        swap_in=[BlockCopy(10, 3), BlockCopy(11, 1), BlockCopy(12, 2)],
    )
    tokens.append(runner.forward(request).generations[0].token_id)
    assert decode(10, 3, tokens) == expected
