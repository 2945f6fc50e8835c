"""The command line: `python -m bench run|sweep|compare ...`; each subcommand's --help lists its flags."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench import report
from bench.client import API_FLAVOURS, RequestRecord, Target
from bench.runner import Arrivals, RunResult, run_load
from bench.stats import ratios, summarize
from bench.workloads import WORKLOAD_HELP, WORKLOADS, RequestSpec, Session, WorkloadConfig, build_workload

DEFAULT_BURST_SIZE = 16
NUM_WARMUP_TOKENS = 16


def _positive_rate(text: str) -> float:
    rate = float(text)
    if not rate > 0:
        raise argparse.ArgumentTypeError(f"a request rate must be > 0 (or inf), got {text}")
    return rate


def _rates(text: str) -> list[float]:
    rates = [_positive_rate(part) for part in text.split(",") if part.strip()]
    if not rates or any(math.isinf(rate) for rate in rates):
        raise argparse.ArgumentTypeError(f"give finite rates separated by commas, e.g. 1,2,4,8; got {text!r}")
    return rates


def _add_target_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("server")
    group.add_argument(
        "--api",
        choices=API_FLAVOURS,
        default="native",
        help="openai: POST /v1/completions (stream, include_usage); chat: POST /v1/chat/completions, "
        "the prompt as one user message; native: Rill/TGI POST /generate_stream (default: %(default)s)",
    )
    group.add_argument(
        "--model",
        help="OpenAI `model` field (default: the first of GET /v1/models, else 'default'); several, "
        "comma-separated, are sent in turn (request i gets the (i mod n)-th: LoRA adapters mixed evenly)",
    )
    group.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="sampling temperature; 0 is greedy (default: %(default)s)",
    )
    group.add_argument(
        "--ignore-eos",
        action="store_true",
        help="OpenAI flavours: send vLLM's ignore_eos=true so every answer runs to its max tokens",
    )
    group.add_argument(
        "--timeout",
        type=float,
        default=600.0,
        help="seconds one request may take before it counts as a timeout (default: %(default)s)",
    )


def _add_workload_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("workload")
    group.add_argument(
        "--workload",
        choices=WORKLOADS,
        default="mixed",
        help="; ".join(f"{name}: {text}" for name, text in WORKLOAD_HELP.items()) + " (default: %(default)s)",
    )
    group.add_argument("--num-requests", type=int, default=100, help="requests in all (default: %(default)s)")
    group.add_argument(
        "--seed",
        type=int,
        default=0,
        help="seeds prompts, lengths and Poisson arrivals; same seed, same requests (default: 0)",
    )
    group.add_argument(
        "--max-tokens",
        type=int,
        help="ask every request for exactly this many output tokens "
        "(default: the workload's output length distribution)",
    )
    group.add_argument(
        "--max-prompt-tokens",
        type=int,
        help="cap drawn prompt lengths of single-prompt workloads (scales a workload down; default: none)",
    )
    group.add_argument(
        "--max-output-tokens",
        type=int,
        help="cap drawn output lengths, which still vary below it (default: none)",
    )
    group.add_argument(
        "--tokenizer",
        type=Path,
        help="a tokenizer.json: prompts are cut to exact token counts "
        "(default: one common English word counts as one token)",
    )


def _add_arrival_flags(parser: argparse.ArgumentParser, is_rate_flag: bool) -> None:
    group = parser.add_argument_group("arrivals")
    if is_rate_flag:
        choice = group.add_mutually_exclusive_group(required=True)
        choice.add_argument(
            "--request-rate",
            type=_positive_rate,
            help="open loop: new sessions per second, Poisson (inf: all at once); "
            "a chat session is 4 requests",
        )
        choice.add_argument(
            "--concurrency",
            type=int,
            help="closed loop: this many sessions in flight, each sending its next request "
            "when the previous one ends",
        )
    group.add_argument(
        "--burst-size",
        type=int,
        help=f"with a request rate, sessions arrive in groups of this size at the same mean rate "
        f"(default: {DEFAULT_BURST_SIZE} for --workload bursts, else one by one)",
    )
    group.add_argument(
        "--duration",
        type=float,
        help="seconds after which no new request starts (in-flight ones finish); default: no bound",
    )
    group.add_argument(
        "--warmup",
        type=int,
        default=0,
        help="unrecorded random-prompt requests sent one by one first (default: %(default)s)",
    )


def _add_output_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("output")
    group.add_argument("--json", type=Path, help="write every figure and every request's record to this file")
    group.add_argument("--plot", type=Path, help="write PNG plots into this folder")
    group.add_argument("--no-progress", action="store_true", help="no progress bar")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m bench",
        description="Rill's load generator for OpenAI-compatible and Rill/TGI-native servers. "
        "See bench/README.md.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="{run,sweep,compare,soak}")
    run = commands.add_parser(
        "run",
        help="one workload against one server",
        description="Run one seeded workload against one server and print its figures.",
    )
    run.add_argument("--url", default="http://127.0.0.1:8080", help="server base URL (default: %(default)s)")
    sweep = commands.add_parser(
        "sweep",
        help="one workload at several request rates",
        description="Run the same seeded workload at each request rate in turn; "
        "--plot adds throughput against offered load.",
    )
    sweep.add_argument(
        "--url", default="http://127.0.0.1:8080", help="server base URL (default: %(default)s)"
    )
    sweep.add_argument(
        "--request-rates",
        type=_rates,
        required=True,
        help="comma-separated offered rates in sessions per second, e.g. 1,2,4,8",
    )
    compare = commands.add_parser(
        "compare",
        help="the same workload against two servers, back to back; prints b/a",
        description="Run the same seeded workload against server a, then server b (back to back, never "
        "interleaved, so neither competes with the other), and print b/a ratios.",
    )
    for side in ("a", "b"):
        compare.add_argument(f"--{side}", required=True, metavar="[LABEL=]URL", help=f"server {side}")
        compare.add_argument(
            f"--{side}-api", choices=API_FLAVOURS, help=f"API flavour of {side} (default: --api)"
        )
        compare.add_argument(f"--{side}-model", help=f"`model` field(s) of {side} (default: --model)")
    compare.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="repeat the pair this many times, alternating the order (ab, ba, ab, ...) to even "
        "out drift; records are pooled per side (default: %(default)s)",
    )
    compare.add_argument(
        "--fresh-prompts",
        action="store_true",
        help="round r is seeded --seed + r: both sides get the same prompts within a round, never a "
        "round's prompts again, so a prefix cache cannot serve a later round from an earlier one",
    )
    _add_soak_parser(commands)
    for sub, is_rate_flag in ((run, True), (sweep, False), (compare, True)):
        _add_target_flags(sub)
        _add_workload_flags(sub)
        _add_arrival_flags(sub, is_rate_flag)
        _add_output_flags(sub)
    return parser


def _add_soak_parser(commands: argparse._SubParsersAction) -> None:
    soak = commands.add_parser(
        "soak",
        help="robustness soak: load beyond capacity, disconnecting clients, malformed requests, "
        "slow readers, deadlines, idle connections",
        description="Keep --capacity-multiple x the server's max_concurrent_requests (GET /info) requests "
        "in flight: a share disconnect at random moments, a share are malformed, a share stop reading, "
        "a share have a short deadline, a share are idle connections; then check that no KV block leaked, "
        "the server is healthy and ready, and count outcomes. Exits 1 on any 5xx (other than 503, and 504 "
        "for a deadline), stream or connection error, timeout, leak, or unhealthy server.",
    )
    soak.add_argument("--url", default="http://127.0.0.1:8080", help="server base URL (default: %(default)s)")
    soak.add_argument(
        "--api",
        choices=API_FLAVOURS,
        default="native",
        help="API of the normal requests (default: %(default)s)",
    )
    soak.add_argument("--model", help="OpenAI `model` field (default: the first of GET /v1/models)")
    soak.add_argument("--num-requests", type=int, default=5000, help="requests in all (default: %(default)s)")
    soak.add_argument(
        "--capacity-multiple",
        type=float,
        default=2.0,
        help="requests in flight, as a multiple of max_concurrent_requests (default: %(default)s)",
    )
    soak.add_argument(
        "--disconnect-share",
        type=float,
        default=0.1,
        help="share of requests the client drops at a random moment (default: %(default)s)",
    )
    soak.add_argument(
        "--disconnect-max-s",
        type=float,
        default=0.5,
        help="a dropped request is dropped after a random delay up to this (default: %(default)s)",
    )
    soak.add_argument(
        "--malformed-share",
        type=float,
        default=0.05,
        help="share of malformed requests: bad JSON, bad fields (default: %(default)s)",
    )
    soak.add_argument(
        "--slow-reader-share",
        type=float,
        default=0.0,
        help="share of long streams whose client stops reading; the server should cut them off "
        "(default: %(default)s)",
    )
    soak.add_argument(
        "--slow-reader-hold-s",
        type=float,
        default=10.0,
        help="a slow reader reads nothing for this long, then reads what is left (default: %(default)s)",
    )
    soak.add_argument(
        "--deadline-share",
        type=float,
        default=0.0,
        help="share of long requests with a short `timeout`, expecting 504 or an SSE error event "
        "(default: %(default)s)",
    )
    soak.add_argument(
        "--deadline-s", type=float, default=0.2, help="the `timeout` of those requests (default: %(default)s)"
    )
    soak.add_argument(
        "--idle-connection-share",
        type=float,
        default=0.0,
        help="share of connections that send nothing, held until the server closes them "
        "(default: %(default)s)",
    )
    soak.add_argument(
        "--idle-connection-max-s",
        type=float,
        default=15.0,
        help="an idle connection the server has not closed is dropped after this long (default: %(default)s)",
    )
    soak.add_argument(
        "--duration", type=float, help="seconds after which no new request starts (default: no bound)"
    )
    soak.add_argument(
        "--max-tokens",
        type=int,
        default=16,
        help="output tokens of each normal request (default: %(default)s)",
    )
    soak.add_argument("--seed", type=int, default=0, help="seeds every draw (default: %(default)s)")
    soak.add_argument(
        "--timeout",
        type=float,
        default=120.0,
        help="seconds one request may take before it counts as a timeout (default: %(default)s)",
    )
    soak.add_argument("--json", type=Path, help="write the figures to this JSON file")
    soak.add_argument("--no-progress", action="store_true", help="no progress bar")


def cmd_soak(args: argparse.Namespace) -> int:
    from bench.soak import SoakConfig, format_soak, run_soak, soak_json

    config = SoakConfig(
        num_requests=args.num_requests,
        capacity_multiple=args.capacity_multiple,
        disconnect_share=args.disconnect_share,
        malformed_share=args.malformed_share,
        duration_s=args.duration,
        max_tokens=args.max_tokens,
        disconnect_max_s=args.disconnect_max_s,
        slow_reader_share=args.slow_reader_share,
        slow_reader_hold_s=args.slow_reader_hold_s,
        deadline_share=args.deadline_share,
        deadline_s=args.deadline_s,
        idle_connection_share=args.idle_connection_share,
        idle_connection_max_s=args.idle_connection_max_s,
        timeout_s=args.timeout,
        seed=args.seed,
    )
    target = Target(url=args.url, api=args.api, model=args.model)
    result = asyncio.run(run_soak(target, config, is_progress_shown=not args.no_progress))
    title = (
        f"soak {args.url} ({args.api}): {args.num_requests} at {args.capacity_multiple:g}x capacity, "
        f"{args.disconnect_share:.0%} disconnecting, {args.malformed_share:.0%} malformed, "
        f"{args.slow_reader_share:.0%} slow readers, {args.deadline_share:.0%} deadlines, "
        f"{args.idle_connection_share:.0%} idle connections, seed {args.seed}"
    )
    print(format_soak(title, result))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"mode": "soak", **soak_json(config, result)}, indent=2) + "\n")
    return 0 if result.is_ok else 1


def _workload(args: argparse.Namespace) -> tuple[list[Session], list[RequestSpec]]:
    sessions = build_workload(
        WorkloadConfig(
            args.workload,
            args.num_requests,
            args.seed,
            args.max_tokens,
            args.tokenizer,
            max_prompt_tokens=args.max_prompt_tokens,
            max_output_tokens=args.max_output_tokens,
        )
    )
    warmup: list[RequestSpec] = []
    if args.warmup > 0:
        config = WorkloadConfig("random", args.warmup, args.seed + 1, NUM_WARMUP_TOKENS, args.tokenizer)
        warmup = [spec for session in build_workload(config) for spec in session]
    return sessions, warmup


def _arrivals(args: argparse.Namespace, request_rate: float | None = None) -> Arrivals:
    burst_size = args.burst_size
    if burst_size is None and args.workload == "bursts":
        burst_size = DEFAULT_BURST_SIZE
    rate = request_rate if request_rate is not None else getattr(args, "request_rate", None)
    concurrency = None if request_rate is not None else getattr(args, "concurrency", None)
    return Arrivals(request_rate=rate, concurrency=concurrency, burst_size=burst_size)


def _target(args: argparse.Namespace, spec: str, api: str | None, model: str | None = None) -> Target:
    label, _, url = spec.partition("=") if "=" in spec.split("://")[0] else ("", "", spec)
    return Target(
        url=url,
        api=api or args.api,
        label=label,
        model=model or args.model,
        temperature=args.temperature,
        ignore_eos=args.ignore_eos,
    )


def _run(args: argparse.Namespace, target: Target, arrivals: Arrivals) -> RunResult:
    sessions, warmup = _workload(args)
    return asyncio.run(
        run_load(
            target,
            sessions,
            arrivals,
            seed=args.seed,
            duration_s=args.duration,
            timeout_s=args.timeout,
            is_progress_shown=not args.no_progress,
            warmup=warmup,
        )
    )


def _title(args: argparse.Namespace, target: Target, arrivals: Arrivals) -> str:
    return (
        f"{target.name} ({target.api}) — workload {args.workload}, {args.num_requests} requests, "
        f"{arrivals.describe()}, seed {args.seed}"
    )


def _config(args: argparse.Namespace) -> dict[str, Any]:
    return {key: (str(value) if isinstance(value, Path) else value) for key, value in vars(args).items()}


def cmd_run(args: argparse.Namespace) -> int:
    target, arrivals = _target(args, args.url, None), _arrivals(args)
    result = _run(args, target, arrivals)
    summary = summarize(result.records, result.duration_s, result.num_planned)
    print(report.format_summary(_title(args, target, arrivals), summary))
    if args.json:
        report.write_json(args.json, "run", _config(args), {"run": report.run_json(result, summary)})
    if args.plot:
        from bench import plots  # matplotlib loads only when plots are asked for

        plots.plot_cdfs(args.plot, {target.name: result.records})
    return 0 if summary["num_completed"] else 1


def cmd_sweep(args: argparse.Namespace) -> int:
    target = _target(args, args.url, None)
    rows: list[tuple[float, dict[str, Any]]] = []
    runs: list[dict[str, Any]] = []
    records = {}
    for rate in args.request_rates:
        arrivals = _arrivals(args, rate)
        result = _run(args, target, arrivals)
        summary = summarize(result.records, result.duration_s, result.num_planned)
        print(report.format_summary(_title(args, target, arrivals), summary), end="\n\n")
        rows.append((rate, summary))
        runs.append({"request_rate": rate, **report.run_json(result, summary)})
        records[f"{rate:g}/s"] = result.records
    print(report.format_sweep(rows))
    if args.json:
        report.write_json(args.json, "sweep", _config(args), {"runs": runs})
    if args.plot:
        from bench import plots  # matplotlib loads only when plots are asked for

        plots.plot_cdfs(args.plot, records)
        plots.plot_throughput(args.plot, rows)
    return 0 if any(summary["num_completed"] for _, summary in rows) else 1


def cmd_compare(args: argparse.Namespace) -> int:
    if args.rounds < 1:
        raise ValueError(f"--rounds must be >= 1, got {args.rounds}")
    targets = {
        "a": _target(args, args.a, args.a_api, args.a_model),
        "b": _target(args, args.b, args.b_api, args.b_model),
    }
    arrivals = _arrivals(args)
    pooled: dict[str, list[RunResult]] = {"a": [], "b": []}
    round_ratios = []
    for round_index in range(args.rounds):
        seed = args.seed + round_index if args.fresh_prompts else args.seed
        round_args = argparse.Namespace(**{**vars(args), "seed": seed})
        throughput = {}
        for side in "ab" if round_index % 2 == 0 else "ba":
            result = _run(round_args, targets[side], arrivals)
            pooled[side].append(result)
            throughput[side] = summarize(result.records, result.duration_s, result.num_planned)
        round_ratios.append(ratios(throughput["a"], throughput["b"])["output_tokens_per_s"])
    summaries, sides = {}, {}
    for side, results in pooled.items():
        records = _records_of(results)
        summaries[side] = summarize(
            records, sum(r.duration_s for r in results), sum(r.num_planned for r in results)
        )
        merged = RunResult(
            targets[side], records, summaries[side]["duration_s"], summaries[side]["num_planned"]
        )
        sides[side] = report.run_json(merged, summaries[side])
        print(report.format_summary(_title(args, targets[side], arrivals), summaries[side]), end="\n\n")
    ratio = ratios(summaries["a"], summaries["b"])
    print(f"compare (back to back, {args.rounds} round(s); ratios are b/a)")
    names = targets["a"].name, targets["b"].name
    print(report.format_compare(*names, summaries["a"], summaries["b"], ratio, round_ratios))
    if args.json:
        body = {**sides, "ratios": ratio, "round_ratios": round_ratios}
        report.write_json(args.json, "compare", _config(args), body)
    if args.plot:
        from bench import plots  # matplotlib loads only when plots are asked for

        plots.plot_cdfs(
            args.plot,
            {
                f"a: {targets['a'].name}": _records_of(pooled["a"]),
                f"b: {targets['b'].name}": _records_of(pooled["b"]),
            },
        )
    return 0 if summaries["a"]["num_completed"] and summaries["b"]["num_completed"] else 1


def _records_of(results: list[RunResult]) -> list[RequestRecord]:
    return [record for result in results for record in result.records]


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    command = {"run": cmd_run, "sweep": cmd_sweep, "compare": cmd_compare, "soak": cmd_soak}[args.command]
    try:
        return command(args)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
