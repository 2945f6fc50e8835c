"""Figures of a run: throughput, latency percentiles, errors; and b/a ratios between two runs.

Percentiles interpolate linearly between samples (numpy's default, as vLLM's benchmark does). Latency figures
count successful requests only; ITL pools the gaps of every successful request. Throughput divides by the
run's wall time, from the first request sent to the last answer ended.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

import numpy as np

from bench.client import RequestRecord

PERCENTILES = (50, 90, 99)


def distribution_ms(values_s: Sequence[float]) -> dict[str, float | None]:
    """mean, p50, p90, p99 and max of `values_s`, in milliseconds; None for each when there is no value."""
    keys = ["mean", *(f"p{p}" for p in PERCENTILES), "max"]
    if len(values_s) == 0:
        return dict.fromkeys(keys, None)
    values = np.asarray(values_s, dtype=np.float64) * 1000.0
    figures = [values.mean(), *np.percentile(values, PERCENTILES), values.max()]
    return {key: float(figure) for key, figure in zip(keys, figures, strict=True)}


def summarize(records: Sequence[RequestRecord], duration_s: float, num_planned: int) -> dict[str, Any]:
    """Every figure of one run, JSON-ready."""
    ok = [record for record in records if record.is_ok]
    errors = Counter(record.error_kind or "unknown" for record in records if not record.is_ok)
    num_output_tokens = sum(record.output_tokens for record in ok)
    tpot = [
        (record.e2e_s - record.ttft_s) / (record.output_tokens - 1)
        for record in ok
        if record.e2e_s is not None and record.ttft_s is not None and record.output_tokens > 1
    ]
    return {
        "num_planned": num_planned,
        "num_sent": len(records),
        "num_completed": len(ok),
        "num_errors": len(records) - len(ok),
        "num_rejected_429": errors.get("429", 0),
        "errors_by_kind": dict(sorted(errors.items())),
        "duration_s": duration_s,
        "requests_per_s": len(ok) / duration_s if duration_s > 0 else 0.0,
        "output_tokens_per_s": num_output_tokens / duration_s if duration_s > 0 else 0.0,
        "num_output_tokens": num_output_tokens,
        "num_prompt_tokens": sum(record.prompt_tokens for record in ok),
        "ttft_ms": distribution_ms([record.ttft_s for record in ok if record.ttft_s is not None]),
        "itl_ms": distribution_ms([gap for record in ok for gap in record.itl_s]),
        "tpot_ms": distribution_ms(tpot),
        "e2e_ms": distribution_ms([record.e2e_s for record in ok if record.e2e_s is not None]),
    }


RATIO_FIGURES: tuple[tuple[str, str, str], ...] = (
    ("output tokens/s", "output_tokens_per_s", ""),
    ("requests/s", "requests_per_s", ""),
    ("TTFT p50 (ms)", "ttft_ms", "p50"),
    ("TTFT p99 (ms)", "ttft_ms", "p99"),
    ("ITL p50 (ms)", "itl_ms", "p50"),
    ("ITL p99 (ms)", "itl_ms", "p99"),
    ("TPOT p50 (ms)", "tpot_ms", "p50"),
    ("e2e p50 (ms)", "e2e_ms", "p50"),
    ("e2e p99 (ms)", "e2e_ms", "p99"),
)
"""(label, summary key, percentile key or "") of the figures `compare` puts side by side."""


def figure(summary: dict[str, Any], key: str, percentile: str) -> float | None:
    value = summary[key][percentile] if percentile else summary[key]
    return None if value is None else float(value)


def ratios(a: dict[str, Any], b: dict[str, Any]) -> dict[str, float | None]:
    """b/a for each figure of `RATIO_FIGURES`, keyed like `ttft_ms.p99`; None when a is 0 or missing."""
    out: dict[str, float | None] = {}
    for _, key, percentile in RATIO_FIGURES:
        value_a, value_b = figure(a, key, percentile), figure(b, key, percentile)
        name = f"{key}.{percentile}" if percentile else key
        out[name] = value_b / value_a if value_a and value_b is not None else None
    return out
