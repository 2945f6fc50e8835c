"""The speculative suite's own arithmetic: acceptance from two `/metrics` samples, and the on/off check that
speculation changed no answer's length."""

from __future__ import annotations

from typing import Any

from bench.speculative import (
    ACCEPTED_TOKENS,
    DRAFT_TOKENS,
    DRAFTS,
    acceptance,
    accepted_by_lookup,
    length_mismatches,
    lookup_proposal,
)


def test_acceptance_is_accepted_over_proposed_between_the_samples() -> None:
    before = {DRAFTS: 10.0, DRAFT_TOKENS: 40.0, ACCEPTED_TOKENS: 20.0}
    after = {DRAFTS: 30.0, DRAFT_TOKENS: 120.0, ACCEPTED_TOKENS: 80.0}
    spec = acceptance(before, after)
    assert spec["acceptance_rate"] == 60 / 80
    assert spec["accepted_per_draft"] == 60 / 20
    assert spec["draft_tokens"] == 80


def test_no_drafts_gives_no_rate() -> None:
    spec = acceptance({}, {})
    assert spec["acceptance_rate"] is None and spec["accepted_per_draft"] is None


def _report(a: list[tuple[int, int, bool]], b: list[tuple[int, int, bool]]) -> dict[str, Any]:
    def side(records: list[tuple[int, int, bool]]) -> dict[str, Any]:
        return {"requests": [{"index": i, "output_tokens": n, "is_ok": ok} for i, n, ok in records]}

    return {"a": side(a), "b": side(b)}


def test_length_mismatches_name_the_requests_that_differ_or_failed_on_one_side() -> None:
    same = [(0, 5, True), (1, 7, True)]
    assert length_mismatches(_report(same, same)) == []
    report = _report([(0, 5, True), (1, 7, True), (2, 3, True)], [(0, 5, True), (1, 8, True), (2, 0, False)])
    assert length_mismatches(report) == [1, 2]


def test_lookup_proposes_what_followed_the_latest_earlier_suffix_never_past_the_end() -> None:
    ids = [9, 1, 2, 3, 1, 2, 4, 1, 2]
    assert lookup_proposal(ids, 9, 4) == [4, 1, 2]  # [1, 2] last seen at 4-5; 3 tokens known after it
    assert lookup_proposal(ids, 6, 4) == [3, 1, 2]  # [3, 1, 2] never came before; [1, 2] at 1-2
    assert lookup_proposal(ids, 3, 4) == []  # 2 occurred nowhere before
    assert lookup_proposal([7, 7, 7, 7], 3, 4) == [7]  # only the tokens before `end` can be proposed


def test_accepted_by_lookup_counts_the_matching_runs_and_the_steps() -> None:
    prompt = [1, 2, 3, 4, 5]
    # step 1: 5 occurred nowhere before, nothing proposed, 1 sampled; step 2: after [1] come 2 3 4 5, all
    # accepted, and 6 sampled: 4 of 6 answer tokens accepted in 2 steps
    assert accepted_by_lookup([*prompt, 1, 2, 3, 4, 5, 6], len(prompt), 4) == (4, 2)
    # k = 2: step 2 accepts 2 3 after [1] and samples 4; step 3 proposes 5 1 after [2, 3, 4], accepts 5, and
    # samples 6 where 1 was proposed
    assert accepted_by_lookup([*prompt, 1, 2, 3, 4, 5, 6], len(prompt), 2) == (3, 3)
    # a proposal wrong from its first token accepts nothing: one token a step
    assert accepted_by_lookup([*prompt, 1, 9, 9], len(prompt), 4) == (0, 3)
