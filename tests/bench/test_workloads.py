"""Workloads: seeded, the right size, and shaped the way each name promises."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from bench.repeat_texts import CODE, PROSE
from bench.runner import Arrivals, arrival_offsets
from bench.workloads import (
    CHAT_TURNS,
    LONG_PROMPT_TOKENS,
    REPEAT_OUTPUT_TOKENS,
    WORKLOADS,
    TextSource,
    WorkloadConfig,
    build_workload,
    repeat_prompts,
)


def flat(name: str, num_requests: int = 40, **kwargs: object) -> list:
    sessions = build_workload(WorkloadConfig(name, num_requests, **kwargs))  # type: ignore[arg-type]
    return [spec for session in sessions for spec in session]


@pytest.mark.parametrize("name", WORKLOADS)
def test_same_seed_same_requests_and_exact_count(name: str) -> None:
    first, again, other = flat(name, seed=3), flat(name, seed=3), flat(name, seed=4)
    assert len(first) == 40
    assert [spec.index for spec in first] == list(range(40))
    assert first == again
    assert [spec.prompt for spec in first] != [spec.prompt for spec in other]


def test_max_tokens_overrides_output_lengths_and_keeps_prompts() -> None:
    drawn, fixed = flat("mixed"), flat("mixed", max_tokens=7)
    assert {spec.max_tokens for spec in fixed} == {7}
    assert len({spec.max_tokens for spec in drawn}) > 1
    assert [spec.prompt for spec in drawn] == [spec.prompt for spec in fixed]


def test_long_prompts_come_among_short_ones() -> None:
    specs = flat("long-prompts", 32)
    long = [spec for spec in specs if spec.prompt_tokens == LONG_PROMPT_TOKENS]
    assert len(long) == 4
    assert all(len(spec.prompt.split()) == LONG_PROMPT_TOKENS for spec in long)
    assert all(spec.prompt_tokens <= 256 for spec in specs if spec not in long)


def test_shared_prefix_shares_about_600_tokens_then_differs() -> None:
    specs = flat("shared-prefix", 20)
    prefix = os.path.commonprefix([spec.prompt for spec in specs])
    assert 570 <= len(prefix.split()) <= 620
    assert len({spec.prompt for spec in specs}) == 20
    assert all(spec.prompt_tokens - len(prefix.split()) <= 60 for spec in specs)


def test_repeat_asks_to_copy_each_passage_with_each_of_its_changes() -> None:
    prompts = repeat_prompts()
    asked = []
    for passage in CODE + PROSE:
        for old, new in passage.changes:
            assert old in passage.text and new not in passage.text, (old, new)
            wanted = [
                p
                for p in prompts
                if passage.text in p and (f"`{old}` to `{new}`" in p or f'"{old}" to "{new}"' in p)
            ]
            assert len(wanted) == 1, (old, new)
            asked += wanted
    assert sorted(asked) == sorted(prompts)
    specs = flat("repeat", 60)
    assert {spec.prompt for spec in specs} <= set(prompts)
    assert len({spec.prompt for spec in specs}) > len(prompts) // 2
    assert {spec.max_tokens for spec in specs} == {REPEAT_OUTPUT_TOKENS}


def test_chat_turns_contain_the_previous_turns() -> None:
    sessions = build_workload(WorkloadConfig("chat", 10))
    assert [len(session) for session in sessions] == [CHAT_TURNS, CHAT_TURNS, 2]
    for session in sessions:
        for earlier, later in zip(session, session[1:], strict=False):
            assert later.prompt.startswith(earlier.prompt)
            assert later.prompt_tokens > earlier.prompt_tokens + earlier.max_tokens
            assert later.turn == earlier.turn + 1


def test_random_prompts_share_no_prefix_block() -> None:
    prompts = [spec.prompt.split() for spec in flat("random", 100)]
    assert len({tuple(words[:16]) for words in prompts}) == 100
    assert len({words[0] for words in prompts}) > 30


def test_tokenizer_cuts_prompts_to_exact_token_counts(tmp_path: Path) -> None:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    corpus = [spec.prompt for spec in flat("random", 20)]
    trainer = trainers.BpeTrainer(vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(corpus, trainer)
    path = tmp_path / "tokenizer.json"
    tokenizer.save(str(path))
    source = TextSource(path)
    specs = flat("mixed", 20, tokenizer_path=path)
    for spec in specs:
        assert abs(source.count(spec.prompt) - spec.prompt_tokens) <= 2
        assert len(spec.prompt.split()) < spec.prompt_tokens  # words span several tokens here


def test_poisson_offsets_have_the_asked_mean_rate() -> None:
    offsets = arrival_offsets(4000, Arrivals(request_rate=20.0), seed=1)
    assert offsets == sorted(offsets)
    assert offsets[-1] / 3999 == pytest.approx(1 / 20.0, rel=0.05)
    assert offsets == arrival_offsets(4000, Arrivals(request_rate=20.0), seed=1)


def test_bursts_arrive_together_at_the_mean_rate() -> None:
    offsets = arrival_offsets(12, Arrivals(request_rate=4.0, burst_size=4), seed=0)
    assert offsets == [0.0] * 4 + [1.0] * 4 + [2.0] * 4


def test_arrivals_need_exactly_one_mode() -> None:
    with pytest.raises(ValueError, match="exactly one"):
        Arrivals()
    with pytest.raises(ValueError, match="bursts need"):
        Arrivals(concurrency=2, burst_size=4)
