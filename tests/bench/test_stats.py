"""Statistics on hand-made records, where every figure is known exactly."""

from __future__ import annotations

import pytest

from bench.client import RequestRecord
from bench.stats import distribution_ms, ratios, summarize


def record(index: int, ttft_s: float, itl_s: list[float], output_tokens: int) -> RequestRecord:
    e2e_s = ttft_s + sum(itl_s)
    return RequestRecord(
        index,
        index,
        0,
        10,
        output_tokens,
        is_ok=True,
        status=200,
        ttft_s=ttft_s,
        e2e_s=e2e_s,
        itl_s=itl_s,
        output_tokens=output_tokens,
    )


def failed(index: int, kind: str) -> RequestRecord:
    return RequestRecord(
        index, index, 0, 10, 5, status=int(kind) if kind.isdigit() else None, error_kind=kind
    )


def test_distribution_matches_linear_interpolation() -> None:
    values = [i / 1000 for i in range(1, 101)]  # 1..100 ms
    figures = distribution_ms(values)
    assert figures["mean"] == pytest.approx(50.5)
    assert figures["p50"] == pytest.approx(50.5)
    assert figures["p90"] == pytest.approx(90.1)
    assert figures["p99"] == pytest.approx(99.01)
    assert figures["max"] == pytest.approx(100.0)


def test_distribution_of_nothing_is_none() -> None:
    assert distribution_ms([]) == {"mean": None, "p50": None, "p90": None, "p99": None, "max": None}


def test_summary_counts_throughput_latencies_and_errors() -> None:
    records = [
        record(0, 0.100, [0.010, 0.020], 3),
        record(1, 0.300, [0.030], 2),
        failed(2, "429"),
        failed(3, "429"),
        failed(4, "500"),
        failed(5, "connection"),
    ]
    summary = summarize(records, duration_s=2.0, num_planned=8)
    assert summary["num_planned"] == 8
    assert summary["num_sent"] == 6
    assert summary["num_completed"] == 2
    assert summary["num_errors"] == 4
    assert summary["num_rejected_429"] == 2
    assert summary["errors_by_kind"] == {"429": 2, "500": 1, "connection": 1}
    assert summary["output_tokens_per_s"] == pytest.approx(5 / 2.0)
    assert summary["requests_per_s"] == pytest.approx(2 / 2.0)
    assert summary["num_prompt_tokens"] == 20
    assert summary["ttft_ms"]["p50"] == pytest.approx(200.0)
    assert summary["ttft_ms"]["max"] == pytest.approx(300.0)
    assert summary["itl_ms"]["mean"] == pytest.approx(20.0)  # pooled gaps 10, 20, 30
    assert summary["itl_ms"]["p50"] == pytest.approx(20.0)
    assert summary["e2e_ms"]["p50"] == pytest.approx((130 + 330) / 2)
    # TPOT = (e2e - ttft) / (tokens - 1): 15 ms and 30 ms
    assert summary["tpot_ms"]["mean"] == pytest.approx(22.5)


def test_ratios_are_b_over_a() -> None:
    a = summarize([record(0, 0.1, [0.01], 2)], duration_s=1.0, num_planned=1)
    b = summarize([record(0, 0.2, [0.03], 2)], duration_s=0.5, num_planned=1)
    ratio = ratios(a, b)
    assert ratio["output_tokens_per_s"] == pytest.approx(2.0)
    assert ratio["ttft_ms.p50"] == pytest.approx(2.0)
    assert ratio["ttft_ms.p99"] == pytest.approx(2.0)
    assert ratio["itl_ms.p99"] == pytest.approx(3.0)


def test_ratio_with_nothing_on_a_is_none() -> None:
    a = summarize([failed(0, "429")], duration_s=1.0, num_planned=1)
    b = summarize([record(0, 0.2, [0.03], 2)], duration_s=1.0, num_planned=1)
    assert ratios(a, b)["ttft_ms.p50"] is None
    assert ratios(a, b)["output_tokens_per_s"] is None
