"""Batch invariance: float32 logits are bitwise identical however a sequence is batched or chunked, on the
CPU kernels and on the torch references."""

from __future__ import annotations

import pytest
import torch
from rill.kernels.ops import AttentionMetadata
from rill.shard.layers import attention
from rill.shard.runner import ModelRunner

from .conftest import chunk, logits_of

PROMPT = [(7 * i + 3) % 300 for i in range(41)]
OTHER = [(11 * i + 5) % 300 for i in range(23)]


def last_logits_alone(runner: ModelRunner) -> torch.Tensor:
    return logits_of(runner, chunk(1, PROMPT, 0, first_block=1))[0]


def scenarios(runner: ModelRunner) -> dict[str, torch.Tensor]:
    """The logits at PROMPT's last position, computed in different ways."""
    results = {"alone": last_logits_alone(runner)}
    batched = logits_of(
        runner,
        chunk(2, OTHER, 0, first_block=40),
        chunk(1, PROMPT, 0, first_block=1),
        chunk(3, [9], 0, first_block=60),
    )
    results["batched"] = batched[1]
    # With a decode of another sequence riding along and a non-sampled chunk of a third.
    logits_of(runner, chunk(2, OTHER[:-1], 0, first_block=40))
    mixed = logits_of(
        runner,
        chunk(2, OTHER[-1:], len(OTHER) - 1, first_block=40),
        chunk(3, OTHER[:7], 0, first_block=60, sample=False),
        chunk(1, PROMPT, 0, first_block=1),
    )
    results["mixed"] = mixed[1]
    for boundaries in ([3, 10], [1, 17, 18, 40], [20]):
        start = 0
        for end in [*boundaries, len(PROMPT)]:
            out = logits_of(
                runner, chunk(1, PROMPT[start:end], start, first_block=1, sample=end == len(PROMPT))
            )
            start = end
        results[f"chunked{boundaries}"] = out[0]
    for position in range(len(PROMPT)):
        out = logits_of(runner, chunk(1, [PROMPT[position]], position, first_block=1))
    results["token_by_token"] = out[0]
    return results


@pytest.mark.parametrize("key_tile_size", [attention.KEY_TILE_SIZE, 8])
def test_logits_bitwise_identical(
    llama_runner_each_backend: ModelRunner, key_tile_size: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(attention, "KEY_TILE_SIZE", key_tile_size)  # the torch reference's tiles
    results = scenarios(llama_runner_each_backend)
    reference = results.pop("alone")
    for name, logits in results.items():
        assert torch.equal(logits, reference), f"{name}: max diff {(logits - reference).abs().max().item()}"


def test_decode_steps_identical_alone_and_batched(llama_runner_each_backend: ModelRunner) -> None:
    llama_runner = llama_runner_each_backend

    def decode(with_others: bool) -> list[torch.Tensor]:
        others = [chunk(2, OTHER, 0, first_block=40)] if with_others else []
        out = logits_of(llama_runner, *others, chunk(1, PROMPT, 0, first_block=1))
        steps = [out[-1]]
        for step in range(4):
            token = int(steps[-1].argmax())
            others = [chunk(2, [step + 1], len(OTHER) + step, first_block=40)] if with_others else []
            out = logits_of(llama_runner, chunk(1, [token], len(PROMPT) + step, first_block=1), *others)
            steps.append(out[0])
        return steps

    for alone, batched in zip(decode(False), decode(True), strict=True):
        assert torch.equal(alone, batched)


def test_tiled_attention_matches_softmax_reference() -> None:
    torch.manual_seed(0)
    q, k, v = torch.randn(5, 4, 8), torch.randn(37, 2, 8), torch.randn(37, 2, 8)
    positions = torch.arange(32, 37)
    out = attention.tiled_causal_attention(q, k, v, positions, scale=8**-0.5, key_tile_size=8)
    k_full, v_full = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k_full) * 8**-0.5
    scores = scores.masked_fill(torch.arange(37)[None, None, :] > positions[None, :, None], float("-inf"))
    expected = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v_full)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_forward_context_refuses_nesting(llama_runner: ModelRunner) -> None:
    empty = torch.zeros(0, dtype=torch.int64)
    meta = AttentionMetadata.build([0], [], torch.zeros(0, 1, dtype=torch.int64), empty, empty)
    ctx = attention.ForwardContext(llama_runner.kv_cache, meta)
    with attention.forward_context(ctx):
        with pytest.raises(RuntimeError, match="already active"):
            with attention.forward_context(ctx):
                pass
    with pytest.raises(RuntimeError, match="outside"):
        attention.get_forward_context()
