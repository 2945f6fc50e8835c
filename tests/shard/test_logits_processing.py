"""Logit processing (bias, penalties, min_new_tokens, temperature/top-k/top-p/min-p/typical-p) and logprobs.

Each batched processor is checked against a per-row reference loop written here (and against transformers'
processors where it has them); then batching, seeding, the runner's token history and the raw logprobs.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch
from rill.shard.batch import BatchLimits, BatchState, ForwardRequest
from rill.shard.runner import ModelRunner
from rill.shard.sampling import (
    SamplingBatch,
    SamplingParams,
    apply_typical_p,
    process_logits,
    sample,
    warp_logits,
)
from transformers import MinPLogitsWarper, RepetitionPenaltyLogitsProcessor, TypicalLogitsWarper

from .conftest import chunk, hf_model, logits_of

CPU = torch.device("cpu")
VOCAB = 40
INF = float("inf")


def random_logits(rows: int, vocab: int = VOCAB, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(rows, vocab, generator=generator) * 3


def build(
    params: Sequence[SamplingParams], histories: Sequence[Sequence[int]], vocab: int = VOCAB
) -> SamplingBatch:
    """Row i generates the token at position len(histories[i])."""
    return SamplingBatch.build(
        params, [len(h) for h in histories], CPU, histories=histories, vocab_size=vocab
    )


# ---- reference implementations: one row at a time, in the documented order ----


def reference_process(row: torch.Tensor, p: SamplingParams, history: Sequence[int]) -> torch.Tensor:
    row = row.clone()
    for token_id, value in p.logit_bias.items():
        row[token_id] += value
    if p.repetition_penalty not in (0.0, 1.0):
        for token_id in set(history):
            if row[token_id] < 0:
                row[token_id] *= p.repetition_penalty
            else:
                row[token_id] /= p.repetition_penalty
    generated = list(history[p.num_prompt_tokens :])
    for token_id in set(generated):
        row[token_id] -= p.frequency_penalty * generated.count(token_id) + p.presence_penalty
    if len(history) - p.num_prompt_tokens < p.min_new_tokens:
        for token_id in p.stop_token_ids:
            row[token_id] = -INF
    return row


def reference_warp(row: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    row = row / p.temperature
    order = sorted(range(len(row)), key=lambda j: (-float(row[j]), j))
    if p.top_k > 0:
        row = row.clone()
        row[order[p.top_k :]] = -INF
    probs = row.softmax(-1).tolist()
    kept, mass = [], 0.0
    for rank, j in enumerate(order):
        if rank > 0 and (mass >= p.top_p or probs[j] == 0):
            break
        kept.append(j)
        mass += probs[j]
    row = torch.where(torch.isin(torch.arange(len(row)), torch.tensor(kept)), row, -INF)
    if p.min_p > 0:
        probs_t = row.softmax(-1)
        row = torch.where(probs_t < p.min_p * probs_t.max(), -INF, row)
    if 0 < p.typical_p < 1:
        probs = row.softmax(-1).tolist()
        entropy = -sum(q * math.log(q) for q in probs if q > 0)
        candidates = sorted(
            (j for j, q in enumerate(probs) if q > 0), key=lambda j: abs(-math.log(probs[j]) - entropy)
        )
        kept, mass = [], 0.0
        for j in candidates:
            kept.append(j)
            mass += probs[j]
            if mass >= p.typical_p:
                break
        row = torch.where(torch.isin(torch.arange(len(row)), torch.tensor(kept)), row, -INF)
    return row


def assert_same_masked(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert torch.equal(actual.isfinite(), expected.isfinite())
    torch.testing.assert_close(actual[actual.isfinite()], expected[expected.isfinite()])


HISTORIES = [
    [3, 5, 5, 7, 9, 9, 9, 1],
    [0, 1, 2, 3, 4, 5, 6, 7, 8, 3, 3],
    [11, 12, 13],
    [4, 4, 4, 4, 20, 21],
    [30, 31, 32, 31, 39],
]
PROCESSED = [
    SamplingParams(repetition_penalty=1.7, num_prompt_tokens=4),
    SamplingParams(frequency_penalty=0.8, presence_penalty=-0.5, num_prompt_tokens=9),
    SamplingParams(logit_bias={0: 5.0, 12: -3.5, 39: 0.25}, num_prompt_tokens=3),
    SamplingParams(
        repetition_penalty=0.6,
        frequency_penalty=-1.2,
        presence_penalty=2.0,
        logit_bias={4: 1.0},
        num_prompt_tokens=2,
        min_new_tokens=5,
        stop_token_ids=(1, 2),
    ),
    SamplingParams(min_new_tokens=2, stop_token_ids=(0, 7), num_prompt_tokens=4),
]


def test_processing_matches_reference_per_row() -> None:
    logits = random_logits(len(PROCESSED))
    processed = process_logits(logits, build(PROCESSED, HISTORIES))
    for i, (p, history) in enumerate(zip(PROCESSED, HISTORIES, strict=True)):
        assert_same_masked(processed[i], reference_process(logits[i], p, history))
    assert not torch.equal(processed, logits)


def test_repetition_penalty_matches_transformers() -> None:
    logits = random_logits(3)
    penalties = [1.3, 0.7, 2.5]
    params = [SamplingParams(repetition_penalty=r, num_prompt_tokens=2) for r in penalties]
    histories = HISTORIES[:3]
    processed = process_logits(logits, build(params, histories))
    for i, penalty in enumerate(penalties):
        expected = RepetitionPenaltyLogitsProcessor(penalty)(torch.tensor([histories[i]]), logits[i : i + 1])
        torch.testing.assert_close(processed[i], expected[0], rtol=0, atol=0)


def test_frequency_and_presence_count_generated_tokens_only() -> None:
    logits = torch.zeros(1, VOCAB)
    p = SamplingParams(frequency_penalty=0.5, presence_penalty=0.25, num_prompt_tokens=3)
    processed = process_logits(logits, build([p], [[6, 6, 8, 6, 6, 9]]))[0]
    assert processed[6].item() == pytest.approx(-(0.5 * 2 + 0.25))  # the prompt's two 6s do not count
    assert processed[9].item() == pytest.approx(-0.75)
    assert processed[8].item() == 0.0  # prompt only


def test_logit_bias_is_added_and_changes_greedy_choice() -> None:
    logits = random_logits(1)
    target = int(logits[0].argmin())
    p = SamplingParams(logit_bias={target: 100.0, 3: -2.0})
    processed = process_logits(logits, build([p], [[]]))
    expected = logits[0].clone()
    expected[target] += 100.0
    expected[3] -= 2.0
    torch.testing.assert_close(processed[0], expected, rtol=0, atol=0)
    assert sample(logits, build([p], [[]])).token_ids.item() == target


def test_min_new_tokens_bans_stop_tokens_until_reached() -> None:
    logits = torch.zeros(1, VOCAB)
    logits[0, 7] = 10.0  # the stop token is the argmax
    p = SamplingParams(num_prompt_tokens=5, min_new_tokens=3, stop_token_ids=(7, 2))
    for position, is_banned in [(5, True), (6, True), (7, True), (8, False), (20, False)]:
        batch = SamplingBatch.build([p], [position], CPU)
        processed = process_logits(logits, batch)[0]
        assert (processed[7].item() == -INF) is is_banned and (processed[2].item() == -INF) is is_banned
        assert (sample(logits, batch).token_ids.item() == 7) is not is_banned
    sampled = dataclasses.replace(p, do_sample=True, seed=3)
    draws = sample(logits.expand(50, VOCAB), SamplingBatch.build([sampled] * 50, list(range(5, 55)), CPU))
    assert 7 not in draws.token_ids[:3].tolist()


WARPED = [
    SamplingParams(do_sample=True, temperature=0.7),
    SamplingParams(do_sample=True, top_k=5),
    SamplingParams(do_sample=True, top_p=0.6),
    SamplingParams(do_sample=True, min_p=0.1),
    SamplingParams(do_sample=True, min_p=0.3, temperature=1.5, top_k=20),
    SamplingParams(do_sample=True, typical_p=0.5),
    SamplingParams(do_sample=True, typical_p=0.9, temperature=0.8, top_p=0.95, min_p=0.02),
    SamplingParams(do_sample=True, top_k=10, top_p=0.8, min_p=0.05, typical_p=0.7, temperature=1.3),
    SamplingParams(do_sample=True, typical_p=0.0, min_p=0.0),  # 0 = off
]


def test_warpers_match_reference_per_row() -> None:
    logits = random_logits(len(WARPED), seed=1)
    warped = warp_logits(logits, SamplingBatch.build(WARPED, [0] * len(WARPED), CPU))
    for i, p in enumerate(WARPED):
        assert_same_masked(warped[i], reference_warp(logits[i], p))
    assert warped[8].isfinite().all()


def test_typical_p_matches_transformers() -> None:
    logits = random_logits(4, vocab=100, seed=2)
    logits[1, :30] = -INF  # already filtered by an earlier warper
    masses = [0.2, 0.5, 0.95, 1.0]
    warped = apply_typical_p(logits, torch.tensor(masses))
    for i, mass in enumerate(masses):
        expected = logits[i] if mass == 1.0 else TypicalLogitsWarper(mass)(None, logits[i : i + 1])[0]
        assert torch.equal(warped[i], expected), i


def test_min_p_matches_transformers() -> None:
    logits = random_logits(3, vocab=100, seed=3)
    params = [SamplingParams(do_sample=True, min_p=m) for m in (0.05, 0.2, 0.6)]
    warped = warp_logits(logits, SamplingBatch.build(params, [0, 0, 0], CPU))
    for i, p in enumerate(params):
        assert torch.equal(warped[i], MinPLogitsWarper(p.min_p)(None, logits[i : i + 1])[0])


def test_sampled_tokens_follow_the_processed_distribution() -> None:
    logits = torch.tensor([[2.0, 1.5, 1.0, 0.0, -1.0, 3.0]])
    p = SamplingParams(do_sample=True, top_k=5, min_p=0.2, logit_bias={5: -2.0}, temperature=0.9)
    num_draws = 4000
    params = [dataclasses.replace(p, seed=seed) for seed in range(num_draws)]
    tokens = sample(logits.expand(num_draws, 6), SamplingBatch.build(params, [4] * num_draws, CPU)).token_ids
    expected = reference_warp(reference_process(logits[0], p, []), p).softmax(-1)
    frequencies = torch.bincount(tokens, minlength=6).float() / num_draws
    assert (frequencies[expected == 0] == 0).all()
    assert (frequencies - expected).abs().max() < 4 * math.sqrt(0.25 / num_draws), frequencies


def test_greedy_rows_take_the_argmax_of_processed_logits() -> None:
    logits = random_logits(len(PROCESSED), seed=4)
    out = sample(logits, build(PROCESSED, HISTORIES))
    for i, (p, history) in enumerate(zip(PROCESSED, HISTORIES, strict=True)):
        assert out.token_ids[i].item() == reference_process(logits[i], p, history).argmax().item()


def test_logprobs_and_top_logprobs_are_of_the_raw_logits() -> None:
    logits = random_logits(4, seed=5)
    params = [
        SamplingParams(top_n_logprobs=5, repetition_penalty=2.0, logit_bias={1: 9.0}),
        SamplingParams(do_sample=True, temperature=0.3, min_p=0.2, top_n_logprobs=20, seed=9),
        SamplingParams(),
        SamplingParams(do_sample=True, typical_p=0.5, top_n_logprobs=1, presence_penalty=1.0),
    ]
    out = sample(logits, build(params, HISTORIES[:4]))
    raw = torch.log_softmax(logits, dim=-1)
    torch.testing.assert_close(out.logprobs, raw.gather(-1, out.token_ids[:, None])[:, 0])
    assert out.top_logprobs.shape == (4, 20)
    for i, p in enumerate(params):
        n = p.top_n_logprobs
        expected_values, expected_ids = raw[i].sort(descending=True)
        assert out.top_token_ids[i, :n].tolist() == expected_ids[:n].tolist()
        torch.testing.assert_close(out.top_logprobs[i, :n], expected_values[:n])
    assert sample(logits, build([SamplingParams()] * 4, HISTORIES[:4])).top_logprobs.shape == (4, 0)


def test_mixed_batch_gives_each_row_what_it_gets_alone() -> None:
    params = [*PROCESSED, *WARPED, SamplingParams(), SamplingParams(do_sample=True, seed=77)]
    params = [
        dataclasses.replace(p, seed=1000 + i, top_n_logprobs=i % 4) if p.do_sample else p
        for i, p in enumerate(params)
    ]
    histories = [HISTORIES[i % len(HISTORIES)] for i in range(len(params))]
    logits = random_logits(len(params), seed=6)
    together = sample(logits, build(params, histories))
    for i, (p, history) in enumerate(zip(params, histories, strict=True)):
        alone = sample(logits[i : i + 1], build([p], [history]))
        assert together.token_ids[i] == alone.token_ids[0], i
        assert torch.equal(together.logprobs[i], alone.logprobs[0])
        n = p.top_n_logprobs
        assert torch.equal(together.top_token_ids[i, :n], alone.top_token_ids[0, :n])
        assert torch.equal(together.top_logprobs[i, :n], alone.top_logprobs[0, :n])


def test_seeded_draw_is_unchanged_by_other_rows_processing() -> None:
    row = random_logits(1, seed=7) / 3
    p = SamplingParams(do_sample=True, top_p=0.9, min_p=0.05, typical_p=0.8, seed=2**40 + 5)
    alone = [sample(row, SamplingBatch.build([p], [pos], CPU)).token_ids.item() for pos in range(30)]
    others = random_logits(len(PROCESSED), seed=8)
    for pos in range(30):
        batch = build([*PROCESSED, p], [*HISTORIES, [1] * pos])
        assert sample(torch.cat([others, row]), batch).token_ids[-1].item() == alone[pos]
    assert len(set(alone)) > 3


@pytest.mark.parametrize(
    ("params", "message"),
    [
        (SamplingParams(repetition_penalty=-1.0), "repetition_penalty"),
        (SamplingParams(repetition_penalty=float("nan")), "repetition_penalty"),
        (SamplingParams(frequency_penalty=2.5), "frequency_penalty"),
        (SamplingParams(presence_penalty=-2.1), "presence_penalty"),
        (SamplingParams(min_p=1.5), "min_p"),
        (SamplingParams(typical_p=-0.1), "typical_p"),
        (SamplingParams(typical_p=1.1), "typical_p"),
        (SamplingParams(top_n_logprobs=21), "top_n_logprobs"),
        (SamplingParams(logit_bias={VOCAB: 1.0}), "logit_bias token ids"),
        (SamplingParams(logit_bias={3: float("inf")}), "logit_bias values"),
        (SamplingParams(stop_token_ids=(VOCAB,)), "stop_token_ids"),
    ],
)
def test_rejects_bad_params(params: SamplingParams, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        params.validate(VOCAB)


def test_accepts_edge_params() -> None:
    for p in (
        SamplingParams(frequency_penalty=-2.0, presence_penalty=2.0, repetition_penalty=0.0),
        SamplingParams(min_p=1.0, typical_p=1.0, top_n_logprobs=20, logit_bias={VOCAB - 1: -100.0}),
    ):
        p.validate(VOCAB)


def test_rejects_cached_token_ids_that_do_not_match() -> None:
    limits = BatchLimits(vocab_size=VOCAB, max_position_embeddings=64, block_size=4, num_blocks=10)
    good = chunk(1, [1, 2], 3, first_block=1, params=SamplingParams())
    for overrides, message in [
        (dict(cached_token_ids=[1, 2]), "cached_token_ids has 2 tokens, num_computed_tokens is 3"),
        (dict(cached_token_ids=[1, 2, VOCAB]), r"cached_token_ids \[40\] out of range"),
        (dict(cached_token_ids=[1, 2, 3], params=None), "cached_token_ids sent without params"),
    ]:
        with pytest.raises(ValueError, match=message):
            BatchState.prepare([dataclasses.replace(good, **overrides)], {1}, limits, CPU)


# ---- the runner's token history, with a real model ----

PROMPT = [3, 141, 59, 26, 53, 58, 97, 1, 141, 59]
PENALIZED = SamplingParams(
    repetition_penalty=1.8,
    frequency_penalty=1.5,
    presence_penalty=0.5,
    logit_bias={5: 1.0},
    num_prompt_tokens=len(PROMPT),
    min_new_tokens=2,
    top_n_logprobs=3,
)


def reference_generate(
    path: Path, prompt: list[int], params: SamplingParams, num_new_tokens: int
) -> list[int]:
    """transformers' model and RepetitionPenaltyLogitsProcessor, plus the reference loop for the rest."""
    model = hf_model(path)
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(num_new_tokens):
            raw = model(torch.tensor([ids])).logits[0, -1:]
            hf = RepetitionPenaltyLogitsProcessor(params.repetition_penalty)(torch.tensor([ids]), raw)[0]
            no_repetition = dataclasses.replace(params, repetition_penalty=1.0)
            ids.append(int(reference_process(hf, no_repetition, ids).argmax()))
    return ids[len(prompt) :]


def test_penalized_generation_over_chunks_matches_reference(
    llama_dir: Path, llama_runner: ModelRunner
) -> None:
    num_new_tokens = 6
    greedy = reference_generate(llama_dir, PROMPT, SamplingParams(), num_new_tokens)
    stops = (greedy[0], greedy[1])  # banned for the first two tokens
    params = dataclasses.replace(PENALIZED, stop_token_ids=stops)
    expected = reference_generate(llama_dir, PROMPT, params, num_new_tokens)
    assert expected != greedy, "the penalties should change the output"

    seq_id, runner = 1001, llama_runner
    runner.forward(ForwardRequest(sequences=[chunk(seq_id, PROMPT[:4], 0, 1, sample=False, params=params)]))
    generations = runner.forward(
        ForwardRequest(sequences=[chunk(seq_id, PROMPT[4:], 4, 1, params=None)])
    ).generations
    tokens = [generations[0].token_id]
    for step in range(num_new_tokens - 1):
        position = len(PROMPT) + step
        generations = runner.forward(
            ForwardRequest(sequences=[chunk(seq_id, tokens[-1:], position, 1, params=None)])
        ).generations
        tokens.append(generations[0].token_id)
    assert tokens == expected
    assert runner.history.get(seq_id) == PROMPT + tokens[:-1]
    assert len(generations[0].top_logprobs) == 3

    runner.forward(ForwardRequest(released_ids=[seq_id], sequences=[chunk(1002, [1], 0, 20)]))
    assert runner.history.get(seq_id) == [] and runner.history.get(1002) == []  # 1002 has no penalty


def test_prefix_hit_with_cached_token_ids_matches_full_prefill(llama_runner: ModelRunner) -> None:
    runner = llama_runner
    full = runner.forward(
        ForwardRequest(sequences=[chunk(1010, PROMPT, 0, 30, params=PENALIZED)])
    ).generations[0]
    # 1011 reuses 1010's first two blocks (positions [0, 8)) and computes the rest into its own block.
    hit = dataclasses.replace(chunk(1011, PROMPT[8:], 8, 30, params=PENALIZED), cached_token_ids=PROMPT[:8])
    hit = dataclasses.replace(hit, block_table=[30, 31, 40])
    generation = runner.forward(ForwardRequest(sequences=[hit])).generations[0]
    assert (generation.token_id, generation.logprob) == (full.token_id, full.logprob)
    assert generation.top_logprobs == full.top_logprobs
    assert runner.history.get(1011) == PROMPT

    missing = dataclasses.replace(hit, id=1012, cached_token_ids=[])
    with pytest.raises(ValueError, match="cached_token_ids must carry them"):
        runner.forward(ForwardRequest(sequences=[missing]))
    assert 1012 not in runner.params_by_id, "a refused call stores nothing"
    runner.clear()
    assert runner.history.token_ids_by_id == {}


def test_known_sequence_with_a_gap_in_history_is_refused(llama_runner: ModelRunner) -> None:
    runner = llama_runner
    runner.forward(ForwardRequest(sequences=[chunk(1020, PROMPT[:4], 0, 50, params=PENALIZED)]))
    with pytest.raises(ValueError, match="the shard has seen fewer"):
        runner.forward(ForwardRequest(sequences=[chunk(1020, PROMPT[6:], 6, 50, params=None)]))
    assert runner.history.get(1020) == PROMPT[:4]


def test_sampled_logprobs_come_from_raw_model_logits(llama_runner: ModelRunner) -> None:
    raw = logits_of(llama_runner, chunk(1030, PROMPT, 0, 60))[0]
    params = dataclasses.replace(PENALIZED, do_sample=True, seed=4, temperature=0.5, top_n_logprobs=20)
    generation = llama_runner.forward(
        ForwardRequest(sequences=[chunk(1031, PROMPT, 0, 70, params=params)])
    ).generations[0]
    raw_logprobs = torch.log_softmax(raw, dim=-1)
    assert generation.logprob == pytest.approx(raw_logprobs[generation.token_id].item(), abs=1e-5)
    values, ids = raw_logprobs.topk(20)
    assert [t.token_id for t in generation.top_logprobs] == ids.tolist()
    assert [t.logprob for t in generation.top_logprobs] == pytest.approx(values.tolist(), abs=1e-5)
