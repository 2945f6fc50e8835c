"""Grammar masks in batched sampling: the bitmask unpacks exactly, constrained rows only ever get allowed
tokens (greedy and sampled, before temperature/top-k/top-p), unconstrained rows in the same batch get the same
tokens as without any mask, and logprobs stay those of the raw distribution."""

from __future__ import annotations

import torch
from rill.shard.sampling import SamplingBatch, SamplingParams, allowed_tokens, sample

VOCAB = 70  # not a multiple of 32: the last word is partial


def pack(allowed: list[int], num_words: int) -> list[int]:
    words = [0] * num_words
    for t in allowed:
        words[t // 32] |= 1 << (t % 32)
    return words


def test_bitmasks_unpack_bit_by_bit() -> None:
    generator = torch.Generator().manual_seed(0)
    expected = torch.rand(3, VOCAB, generator=generator) < 0.3
    words = [pack(row.nonzero().flatten().tolist(), 3) for row in expected]
    assert torch.equal(allowed_tokens(torch.tensor(words, dtype=torch.int64), VOCAB), expected)
    # A short mask disallows the tokens past its last word; bit 31 (the sign bit of an int32) works.
    short = allowed_tokens(torch.tensor([[1 << 31]], dtype=torch.int64), VOCAB)
    assert short[0].nonzero().flatten().tolist() == [31]


def test_constrained_rows_sample_only_allowed_tokens_and_others_are_unchanged() -> None:
    generator = torch.Generator().manual_seed(1)
    allowed = [5, 33, 64, 69]
    params = [
        SamplingParams(),
        SamplingParams(do_sample=True, temperature=1.5, top_k=3, top_p=0.9, seed=7),
        SamplingParams(do_sample=True, seed=9),
        SamplingParams(do_sample=True, seed=9),
    ]
    masks = [pack(allowed, 3), pack(allowed, 3), [], []]
    for step in range(50):
        logits = torch.randn(4, VOCAB, generator=generator) * 4
        positions = [step] * 4
        constrained = sample(
            logits, SamplingBatch.build(params, positions, torch.device("cpu"), allowed_token_bitmasks=masks)
        )
        free = sample(logits, SamplingBatch.build(params, positions, torch.device("cpu")))
        assert constrained.token_ids[0].item() == max(allowed, key=lambda t: logits[0, t].item())
        assert constrained.token_ids[1].item() in allowed
        assert torch.equal(constrained.token_ids[2:], free.token_ids[2:])
        raw = logits.log_softmax(dim=-1).gather(-1, constrained.token_ids[:, None]).squeeze(-1)
        torch.testing.assert_close(constrained.logprobs, raw)  # float32 rounding of log-softmax apart


def test_noise_never_reaches_one_so_masked_tokens_never_win() -> None:
    # The top hash value used to round to u = 1.0 in float32: Gumbel noise +inf, and -inf + inf = NaN won.
    from rill.shard.sampling import uniform_noise

    seeds = torch.arange(64, dtype=torch.int64)
    u = uniform_noise(seeds, seeds * 0, seeds * 0 + 43, 49152)
    assert bool((u < 1).all()) and bool((u > 0).all())
