"""PNG plots with matplotlib's object API (`Figure`, which renders with Agg; no pyplot, no display needed).

- `ttft_cdf.png`, `itl_cdf.png`, `e2e_cdf.png`: the cumulative distribution of each latency, one line per run
  (one run for `run`, a and b for `compare`, one per rate for `sweep`);
- `throughput_vs_load.png` (sweep): achieved output tokens/s, completed requests/s, and TTFT p50/p99 and
  ITL p99, each against the offered request rate.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from matplotlib.figure import Figure

from bench.client import RequestRecord

_LATENCIES = (
    ("ttft", "time to first token (ms)"),
    ("itl", "inter-token latency (ms)"),
    ("e2e", "end-to-end latency (ms)"),
)


def _values_ms(records: Sequence[RequestRecord], latency: str) -> list[float]:
    ok = [record for record in records if record.is_ok]
    if latency == "ttft":
        return [record.ttft_s * 1000 for record in ok if record.ttft_s is not None]
    if latency == "itl":
        return [gap * 1000 for record in ok for gap in record.itl_s]
    return [record.e2e_s * 1000 for record in ok if record.e2e_s is not None]


def plot_cdfs(directory: Path, runs: Mapping[str, Sequence[RequestRecord]]) -> list[Path]:
    """One CDF per latency, a line per labelled run; returns the files written."""
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    for latency, axis_label in _LATENCIES:
        figure = Figure(figsize=(7, 4.5))
        axes = figure.subplots()
        for label, records in runs.items():
            values = np.sort(np.asarray(_values_ms(records, latency)))
            if len(values):
                axes.step(values, np.arange(1, len(values) + 1) / len(values), where="post", label=label)
        axes.set_xlabel(axis_label)
        axes.set_ylabel("fraction of samples")
        axes.set_ylim(0, 1.02)
        axes.grid(alpha=0.3)
        if runs:
            axes.legend()
        path = directory / f"{latency}_cdf.png"
        figure.tight_layout()
        figure.savefig(path, dpi=110)
        written.append(path)
    return written


def plot_throughput(directory: Path, rows: Sequence[tuple[float, dict[str, Any]]]) -> Path:
    """Against the offered rate: output tokens/s, completed requests/s (with the offered line), latencies."""
    directory.mkdir(parents=True, exist_ok=True)
    rates = [rate for rate, _ in rows]
    figure = Figure(figsize=(15, 4.5))
    tokens_axis, requests_axis, latency_axis = figure.subplots(1, 3)
    tokens_axis.plot(rates, [s["output_tokens_per_s"] for _, s in rows], "o-")
    tokens_axis.set_ylabel("output tokens/s")
    requests_axis.plot(rates, [s["requests_per_s"] for _, s in rows], "o-", label="completed")
    requests_axis.plot(rates, rates, ":", color="gray", label="offered")
    requests_axis.set_ylabel("requests/s")
    requests_axis.legend()
    for key, percentile, style in (
        ("ttft_ms", "p50", "o-"),
        ("ttft_ms", "p99", "o--"),
        ("itl_ms", "p99", "s-"),
    ):
        values = [s[key][percentile] for _, s in rows]
        latency_axis.plot(rates, [math.nan if v is None else v for v in values], style,
                          label=f"{key.split('_')[0].upper()} {percentile}")  # fmt: skip
    latency_axis.set_ylabel("latency (ms)")
    latency_axis.set_yscale("log")
    latency_axis.legend()
    for axes in (tokens_axis, requests_axis, latency_axis):
        axes.set_xlabel("offered load (requests/s)")
        axes.grid(alpha=0.3)
    figure.suptitle("throughput and latency against offered load")
    path = directory / "throughput_vs_load.png"
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    return path
