"""The speculative suite's own arithmetic: acceptance from two `/metrics` samples, and the on/off check that
speculation changed no answer's length."""

from __future__ import annotations

from typing import Any

from bench.speculative import ACCEPTED_TOKENS, DRAFT_TOKENS, DRAFTS, acceptance, length_mismatches


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
