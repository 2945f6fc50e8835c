"""BatchState.prepare: flattening, slot mapping, and clear errors for bad input; KV cache scatter."""

from __future__ import annotations

import pytest
import torch
from rill.shard.batch import BatchLimits, BatchState, SequenceChunk
from rill.shard.kv_cache import KVCache
from rill.shard.sampling import SamplingParams

LIMITS = BatchLimits(vocab_size=100, max_position_embeddings=64, block_size=4, num_blocks=10)
CPU = torch.device("cpu")


def seq(**overrides: object) -> SequenceChunk:
    fields = dict(
        id=1,
        token_ids=[1, 2, 3],
        num_computed_tokens=2,
        block_table=[7, 3],
        sample=True,
        params=SamplingParams(),
    )
    return SequenceChunk(**{**fields, **overrides})


def test_flattens_sequences() -> None:
    batch = BatchState.prepare(
        [seq(), seq(id=2, token_ids=[9], num_computed_tokens=0, block_table=[5], sample=False)],
        set(),
        LIMITS,
        CPU,
    )
    assert batch.input_ids.tolist() == [1, 2, 3, 9]
    assert batch.positions.tolist() == [2, 3, 4, 0]
    assert batch.slot_mapping.tolist() == [7 * 4 + 2, 7 * 4 + 3, 3 * 4 + 0, 5 * 4 + 0]
    assert batch.cu_seqlens_q == [0, 3, 4]
    assert batch.context_lens == [5, 1]
    assert batch.block_tables.tolist() == [[7, 3], [5, 0]]
    assert batch.sample_rows.tolist() == [2] and batch.sample_ids == [1] and batch.sample_positions == [5]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (dict(block_table=[7]), "block_table has 1 blocks"),
        (dict(block_table=[7, 0]), "null block"),
        (dict(block_table=[7, 10]), r"out of range \[1, 10\)"),
        (dict(token_ids=[1, 100]), r"token_ids \[100\] out of range"),
        (dict(token_ids=[]), "token_ids is empty"),
        (dict(params=None), "params missing"),
        (dict(params=SamplingParams(do_sample=True, temperature=0.0)), "temperature must be > 0"),
        (dict(params=SamplingParams(do_sample=True, top_p=0.0)), "top_p"),
        (dict(num_computed_tokens=62, block_table=list(range(1, 10)) + [1] * 7), "max_position_embeddings"),
    ],
)
def test_rejects_bad_input(overrides: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        BatchState.prepare([seq(**overrides)], set(), LIMITS, CPU)


def test_rejects_duplicate_ids_and_accepts_known_ids_without_params() -> None:
    with pytest.raises(ValueError, match="more than once"):
        BatchState.prepare([seq(), seq()], set(), LIMITS, CPU)
    BatchState.prepare([seq(params=None)], {1}, LIMITS, CPU)


def test_store_kv_scatters_into_slots() -> None:
    cache = KVCache(
        num_layers=2, num_blocks=4, block_size=2, num_kv_heads=1, head_dim=3, dtype=torch.float32, device=CPU
    )
    k = torch.arange(6.0).view(2, 1, 3)
    cache.store_kv(1, k, -k, torch.tensor([5, 2]))
    assert torch.equal(cache.k[1][2, 1], k[0]) and torch.equal(cache.k[1][1, 0], k[1])
    assert torch.equal(cache.v[1][2, 1], -k[0])
    assert cache.k[0].abs().sum() == 0


def test_null_blocks_only_out_of_an_all_layer_window() -> None:
    """With every layer windowed (8 tokens), a query at position 13 reads positions 6..13: blocks 0 (0..3)
    may be the null block (the router released it), block 1 (4..7) may not."""
    windowed = BatchLimits(
        vocab_size=100, max_position_embeddings=64, block_size=4, num_blocks=10, kv_window=8
    )
    chunk = seq(token_ids=[1], num_computed_tokens=13, block_table=[0, 5, 6, 7])
    batch = BatchState.prepare([chunk], set(), windowed, CPU)
    assert batch.slot_mapping.tolist() == [7 * 4 + 1]
    with pytest.raises(ValueError, match="null block"):
        BatchState.prepare(
            [seq(token_ids=[1], num_computed_tokens=13, block_table=[0, 0, 6, 7])], set(), windowed, CPU
        )
    with pytest.raises(ValueError, match="null block"):
        BatchState.prepare([chunk], set(), LIMITS, CPU)
