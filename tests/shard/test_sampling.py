"""Batched sampling: masks, greedy, logprobs, and seeded draws that do not depend on the rest of the batch."""

from __future__ import annotations

import math

import pytest
import torch
from rill.kernels import cpu as cpu_kernels
from rill.shard.sampling import SamplingBatch, SamplingParams, apply_top_k_top_p, sample, uniform_noise

CPU = torch.device("cpu")


def test_top_k_and_top_p_masks() -> None:
    logits = torch.log(torch.tensor([[0.1, 0.4, 0.2, 0.3], [0.1, 0.4, 0.2, 0.3], [0.25, 0.25, 0.25, 0.25]]))
    masked = apply_top_k_top_p(logits, top_k=torch.tensor([2, 0, 0]), top_p=torch.tensor([1.0, 0.65, 0.5]))
    is_kept = masked.isfinite()
    assert is_kept[0].tolist() == [False, True, False, True]  # top-2
    assert is_kept[1].tolist() == [False, True, False, True]  # 0.4 + 0.3 reaches 0.65
    assert is_kept[2].tolist() == [True, True, False, False]  # ties broken by index
    assert torch.equal(masked[is_kept], logits[is_kept])


def test_top_p_keeps_at_least_one_token() -> None:
    logits = torch.tensor([[5.0, 1.0, 0.0]])
    masked = apply_top_k_top_p(logits, torch.tensor([0]), torch.tensor([0.01]))
    assert masked.isfinite().tolist() == [[True, False, False]]


def test_greedy_rows_take_argmax_and_logprob_is_untempered() -> None:
    torch.manual_seed(0)
    logits = torch.randn(3, 50)
    params = [SamplingParams(), SamplingParams(do_sample=True, temperature=0.5, seed=1), SamplingParams()]
    out = sample(logits, SamplingBatch.build(params, [4, 4, 9], CPU))
    tokens, logprobs = out.token_ids, out.logprobs
    assert tokens[0] == logits[0].argmax() and tokens[2] == logits[2].argmax()
    expected = torch.log_softmax(logits, dim=-1)[torch.arange(3), tokens]
    torch.testing.assert_close(logprobs, expected)


def test_seeded_draw_depends_only_on_seed_and_position() -> None:
    torch.manual_seed(0)
    row = torch.randn(1, 300)
    params = SamplingParams(do_sample=True, temperature=1.0, top_k=100, top_p=0.9, seed=2**63 + 12345)
    alone = sample(row, SamplingBatch.build([params], [17], CPU)).token_ids
    others = torch.randn(5, 300)
    other_params = [SamplingParams(do_sample=True, seed=s) for s in range(4)] + [SamplingParams()]
    batch_logits = torch.cat([others[:2], row, others[2:]])
    batch_params = other_params[:2] + [params] + other_params[2:]
    batched = sample(batch_logits, SamplingBatch.build(batch_params, [3, 99, 17, 5, 6, 7], CPU)).token_ids
    assert batched[2] == alone[0]
    draws = {int(sample(row, SamplingBatch.build([params], [p], CPU)).token_ids[0]) for p in range(40)}
    assert len(draws) > 5, "different positions must draw different noise"


def test_noise_is_uniform_in_open_interval() -> None:
    u = uniform_noise(torch.tensor([7]), torch.tensor([0]), torch.tensor([3]), 100_000)
    assert 0 < u.min() and u.max() < 1
    assert abs(u.mean().item() - 0.5) < 0.01
    assert u.unique().numel() > 99_000


def test_sampled_frequencies_follow_the_distribution() -> None:
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    num_draws = 4000
    logits = probs.log().expand(num_draws, 4)
    params = [SamplingParams(do_sample=True, temperature=1.0, seed=seed) for seed in range(num_draws)]
    tokens = sample(logits, SamplingBatch.build(params, [10] * num_draws, CPU)).token_ids
    frequencies = torch.bincount(tokens, minlength=4).float() / num_draws
    tolerance = 4 * math.sqrt(0.25 / num_draws)
    assert (frequencies - probs).abs().max() < tolerance, frequencies


@pytest.mark.skipif(
    cpu_kernels.CpuOps().unavailable_reason() is not None,
    reason="no C++ compiler or ninja for the CPU kernels",
)
def test_cpu_kernel_row_reductions_sample_as_torch() -> None:
    torch.manual_seed(3)
    logits = torch.randn(6, 1000) * 3
    logits[2, [10, 500]] = 20.0  # a tie for the greedy row: the first wins either way
    params = [
        SamplingParams(top_n_logprobs=5),
        SamplingParams(do_sample=True, temperature=0.8, top_k=50, seed=1, top_n_logprobs=2),
        SamplingParams(),
        SamplingParams(do_sample=True, seed=2),
        SamplingParams(repetition_penalty=1.3, top_n_logprobs=3),
        SamplingParams(do_sample=True, top_p=0.5, seed=3),
    ]
    batch = SamplingBatch.build(params, [4] * 6, CPU, histories=[[1, 2, 3]] * 6, vocab_size=1000)
    torch_out = sample(logits, batch, None)
    kernel_out = sample(logits, batch, cpu_kernels.CpuOps())
    assert torch_out.token_ids[2].item() == 10
    assert torch.equal(kernel_out.token_ids, torch_out.token_ids)
    assert torch.equal(kernel_out.top_token_ids, torch_out.top_token_ids)
    torch.testing.assert_close(kernel_out.logprobs, torch_out.logprobs)
    torch.testing.assert_close(kernel_out.top_logprobs, torch_out.top_logprobs)
    raw = logits.log_softmax(-1)[torch.arange(6), kernel_out.token_ids]
    torch.testing.assert_close(kernel_out.logprobs, raw)
