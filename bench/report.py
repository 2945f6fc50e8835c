"""The printed tables and the JSON file."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from bench.runner import RunResult
from bench.stats import RATIO_FIGURES, figure

SCHEMA_VERSION = 1
LATENCIES = (("TTFT", "ttft_ms"), ("ITL", "itl_ms"), ("TPOT", "tpot_ms"), ("e2e", "e2e_ms"))


def _number(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def errors_text(summary: dict[str, Any]) -> str:
    if not summary["num_errors"]:
        return "none"
    kinds = ", ".join(f"{kind} x{count}" for kind, count in summary["errors_by_kind"].items())
    return f"{summary['num_errors']} ({kinds}); rejected with 429: {summary['num_rejected_429']}"


def format_summary(title: str, summary: dict[str, Any]) -> str:
    """One run as a table: counts and throughput, then latency percentiles in ms."""
    lines = [
        title,
        f"  {'completed':<18}{summary['num_completed']} of {summary['num_sent']} sent"
        f" ({summary['num_planned']} planned)",
        f"  {'errors':<18}{errors_text(summary)}",
        f"  {'duration':<18}{summary['duration_s']:.2f} s",
        f"  {'requests/s':<18}{summary['requests_per_s']:.2f}",
        f"  {'output tokens/s':<18}{summary['output_tokens_per_s']:,.1f}"
        f"  ({summary['num_output_tokens']:,} tokens; prompts {summary['num_prompt_tokens']:,} tokens)",
        "",
        f"  {'latency (ms)':<14}" + "".join(f"{name:>10}" for name in ("mean", "p50", "p90", "p99", "max")),
    ]
    for label, key in LATENCIES:
        row = summary[key]
        lines.append(
            f"  {label:<14}" + "".join(f"{_number(row[p]):>10}" for p in ("mean", "p50", "p90", "p99", "max"))
        )
    return "\n".join(lines)


def format_sweep(rows: list[tuple[float, dict[str, Any]]]) -> str:
    """One line per offered request rate."""
    header = (
        "offered/s",
        "req/s",
        "out tok/s",
        "TTFT p50",
        "TTFT p99",
        "ITL p50",
        "ITL p99",
        "e2e p99",
        "errors",
    )
    lines = ["sweep (latencies in ms)", "  " + "".join(f"{name:>11}" for name in header)]
    for rate, s in rows:
        cells = [
            f"{rate:g}",
            f"{s['requests_per_s']:.2f}",
            f"{s['output_tokens_per_s']:,.1f}",
            _number(s["ttft_ms"]["p50"]),
            _number(s["ttft_ms"]["p99"]),
            _number(s["itl_ms"]["p50"]),
            _number(s["itl_ms"]["p99"]),
            _number(s["e2e_ms"]["p99"]),
            str(s["num_errors"]),
        ]
        lines.append("  " + "".join(f"{cell:>11}" for cell in cells))
    return "\n".join(lines)


def format_compare(
    name_a: str,
    name_b: str,
    a: dict[str, Any],
    b: dict[str, Any],
    ratio: dict[str, float | None],
    round_ratios: Sequence[float | None] = (),
) -> str:
    """The figures of both sides and b/a; with more than one round, b/a of output tokens/s in each."""
    width = max(14, len(name_a) + 2, len(name_b) + 2)
    lines = [f"  {'':<18}{'a: ' + name_a:>{width}}{'b: ' + name_b:>{width}}{'b/a':>10}"]
    for label, key, percentile in RATIO_FIGURES:
        name = f"{key}.{percentile}" if percentile else key
        lines.append(
            f"  {label:<18}{_number(figure(a, key, percentile)):>{width}}"
            f"{_number(figure(b, key, percentile)):>{width}}{_number(ratio[name], 3):>10}"
        )
    lines.append(f"  {'errors':<18}{a['num_errors']:>{width}}{b['num_errors']:>{width}}")
    if len(round_ratios) > 1:
        lines.append("  output tokens/s b/a by round: " + ", ".join(_number(r, 3) for r in round_ratios))
    return "\n".join(lines)


def run_json(result: RunResult, summary: dict[str, Any]) -> dict[str, Any]:
    """One run: its target, its summary and every request's record."""
    return {
        "target": asdict(result.target),
        "summary": summary,
        "requests": [asdict(record) for record in result.records],
    }


def write_json(path: Path, mode: str, config: dict[str, Any], body: dict[str, Any]) -> None:
    """`{"schema_version", "mode", "config", **body}`; `body` depends on the mode (see bench/README.md)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    document = {"schema_version": SCHEMA_VERSION, "mode": mode, "config": config, **body}
    path.write_text(json.dumps(document, indent=2) + "\n")
