"""Rill's own benchmark suite: starts Rill in the configurations to compare, runs the same seeded workload
against each (back to back, in one run), and prints the ratios that docs/benchmarks.md reports.

    python -m bench.suite scheduling   # continuous vs --scheduling static (mixed workload)
    python -m bench.suite itl          # ITL while 4,000-token prompts arrive, with/without --target-itl-ms
    python -m bench.suite overhead     # share of each step outside the model forward at 1, 8, 32 sequences
    python -m bench.suite prefix-cache # shared prefix, 4-turn chat and random prompts, cache on vs off
    python -m bench.suite roofline     # memory bandwidth, GEMM rate, decode steps and prefill vs their floor
    python -m bench.suite peers        # Rill vs llama.cpp's server, same model, workload and machine
    python -m bench.suite peers-gguf   # the same with both loading one GGUF file (Q4_1, Q8_0); memory too
    python -m bench.suite dtypes       # Rill in bfloat16 vs float32 on the peers workload, alternating rounds
    python -m bench.suite constrained  # step time with 0, 8, 32 grammar-constrained sequences of 32; compile
    python -m bench.suite agents       # multi-turn agents under cache churn: chat vs pins vs Responses
    python -m bench.suite lora         # the peers workload with 0, 1 and 8 LoRA adapters vs no LoRA
    python -m bench.suite speculative  # prompt-lookup speculation on vs off, on answers that copy and don't

Every suite runs the default model on the CPU unless `--device`/`--model-id` say otherwise; `--json PATH`
keeps every figure. The machine is shared and noisy: compare ratios measured in one run, not absolutes.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench import agents, lora, peers, roofline, speculative
from bench.harness import Server, bench, compare, metrics, ratio, rill


def suite_scheduling(args: argparse.Namespace) -> dict[str, Any]:
    flags = ["--max-batch-size", "16", "--max-batch-total-tokens", "60000"]
    workload = ["--workload", "mixed", "--num-requests", str(args.num_requests), "--concurrency", "16",
                "--max-prompt-tokens", "512", "--max-output-tokens", "256"]  # fmt: skip
    with (
        rill(args, "continuous", *flags) as continuous,
        rill(args, "static", *flags, "--scheduling", "static", "--static-batch-wait-ms", "2000") as static,
    ):
        report = compare(args, static, continuous, *workload)
    r = report["ratios"]
    ttft_gain = 1 / r["ttft_ms.p99"] if r["ttft_ms.p99"] else None
    print(f"\ncontinuous / static: output tokens/s {ratio(r['output_tokens_per_s'])}, "
          f"TTFT p99 static/continuous {ratio(ttft_gain)}")  # fmt: skip
    return report


def suite_itl(args: argparse.Namespace) -> dict[str, Any]:
    flags = ["--max-batch-total-tokens", "60000", "--max-batch-tokens", "2048"]
    workload = ["--workload", "long-prompts", "--num-requests", str(args.num_requests),
                "--request-rate", "0.5", "--max-output-tokens", "64"]  # fmt: skip
    target = str(args.target_itl_ms)
    with rill(args, "fixed-budget", *flags) as fixed:
        with rill(args, "target-itl", *flags, "--target-itl-ms", target) as tuned:
            report = compare(args, fixed, tuned, *workload)
    itl_b = report["b"]["summary"]["itl_ms"]["p99"]
    itl_a = report["a"]["summary"]["itl_ms"]["p99"]
    print(f"\nITL p99: fixed budget {itl_a:.0f} ms, --target-itl-ms {target}: {itl_b:.0f} ms "
          f"({itl_b / float(target):.2f}x the target)")  # fmt: skip
    return report


def engine_seconds(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Steps, and seconds of step (the forward call, as the router sees it), model forward (as the shards
    report it) and the engine's own planning, between two `metrics` samples."""

    def delta(name: str) -> float:
        return after[name] - before[name]

    return {
        "steps": delta("rill_step_duration_seconds_count"),
        "step_s": delta("rill_step_duration_seconds_sum"),
        "model_s": delta("rill_model_forward_seconds_total"),
        "planning_s": delta("rill_engine_planning_seconds_total"),
    }


def suite_overhead(args: argparse.Namespace) -> dict[str, Any]:
    rows = {}
    with rill(args, "overhead", "--max-batch-total-tokens", "60000") as server:
        for concurrency in (1, 8, 32):
            before = metrics(server)
            bench(args, "run", "--url", server.url, "--no-progress", "--workload", "random",
                  "--num-requests", str(concurrency * 2), "--concurrency", str(concurrency),
                  "--max-prompt-tokens", "64", "--max-tokens", "48")  # fmt: skip
            row = engine_seconds(before, metrics(server))
            iteration_s = row["step_s"] + row["planning_s"]
            row["planning_share"] = row["planning_s"] / iteration_s
            row["outside_share"] = 1 - row["model_s"] / iteration_s
            rows[concurrency] = row
    print("\nrunning sequences | steps | mean iteration (ms) | outside the model forward | router planning")
    for concurrency, row in rows.items():
        iteration_ms = 1e3 * (row["step_s"] + row["planning_s"]) / row["steps"]
        print(f"{concurrency:>17} | {row['steps']:>5.0f} | {iteration_ms:>19.1f} | "
              f"{100 * row['outside_share']:>24.1f}% | {100 * row['planning_share']:>14.2f}%")  # fmt: skip
    return {"rows": rows}


def suite_dtypes(args: argparse.Namespace) -> dict[str, Any]:
    """Rill in bfloat16 against Rill in float32 on the peers workload: both servers up, `--rounds` rounds of
    the pair in alternating order, new prompts each round (so no round hits the prefix cache of an earlier
    one); the machine's speed drifts between runs by more than single runs could resolve."""
    flags = ["--max-batch-size", str(peers.CLIENTS)]
    with (
        rill(args, "float32", "--dtype", "float32", *flags) as f32,
        rill(args, "bfloat16", "--dtype", "bfloat16", *flags) as bf16,
    ):
        alternating = ["--rounds", str(args.rounds), "--fresh-prompts"]
        report = compare(args, f32, bf16, *peers.workload(args), *alternating)
    r = report["ratios"]
    rounds = ", ".join(f"{value:.2f}" for value in report["round_ratios"])
    print(f"\nbfloat16 / float32 ({args.num_threads} threads): output tokens/s "
          f"{ratio(r['output_tokens_per_s'])} (by round: {rounds}), TTFT p50 {ratio(r['ttft_ms.p50'])}, "
          f"ITL p50 {ratio(r['itl_ms.p50'])}")  # fmt: skip
    return report


# Constrained sequences run to max_tokens: at least 40 strings must come before the array may close.
LONG_SCHEMA = {"type": "array", "items": {"type": "string", "maxLength": 12}, "minItems": 40}


def post_chat(server: Server, body: dict[str, Any]) -> None:
    request = urllib.request.Request(
        f"{server.url}/v1/chat/completions", data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )  # fmt: skip
    with urllib.request.urlopen(request, timeout=900) as response:
        response.read()


def compile_seconds(before: dict[str, float], after: dict[str, float], cache: str) -> float:
    """Mean `rill_grammar_compile_seconds{cache=...}` between two samples."""

    def delta(kind: str) -> float:
        name = f'rill_grammar_compile_seconds_{kind}{{cache="{cache}"}}'
        return after[name] - before.get(name, 0.0)

    return delta("sum") / delta("count")


def suite_constrained(args: argparse.Namespace) -> dict[str, Any]:
    """32 concurrent chat requests of 48 tokens, 0, 8 or 32 of them under a JSON Schema (the others ignore
    EOS, so every sequence runs all 48 steps): the mean step (forward + the router's planning, which holds
    the mask computation) and the mask time per step, from the router's metrics; then one schema compiled
    cold, and the same one again (cached)."""
    from concurrent.futures import ThreadPoolExecutor

    rows: dict[int, dict[str, float]] = {}
    messages = [{"role": "user", "content": "List words."}]
    base = {"messages": messages, "max_tokens": 48, "temperature": 1.0}
    with rill(args, "constrained", "--max-batch-total-tokens", "60000") as server:
        for num_constrained in (0, 8, 32):
            constrained, free = {"guided_json": LONG_SCHEMA}, {"ignore_eos": True}
            bodies = [
                {**base, "seed": i, **(free if i >= num_constrained else constrained)} for i in range(32)
            ]
            post_chat(server, bodies[0])  # compile (and warm) before measuring
            before = metrics(server)
            with ThreadPoolExecutor(32) as pool:
                list(pool.map(lambda body: post_chat(server, body), bodies))
            after = metrics(server)
            row = engine_seconds(before, after)
            mask = "rill_grammar_mask_seconds_total"
            row["mask_s"] = after[mask] - before[mask]
            rows[num_constrained] = row
        schema = {**LONG_SCHEMA, "title": f"cold-{time.time()}"}
        compile_s = {}
        for cache in ("miss", "hit"):
            before = metrics(server)
            post_chat(server, {**base, "max_tokens": 1, "guided_json": schema})
            compile_s[cache] = compile_seconds(before, metrics(server), cache)
    print("\nconstrained of 32 | steps | mean step + planning (ms) | masks per step (ms)")
    for num_constrained, row in rows.items():
        iteration_ms = 1e3 * (row["step_s"] + row["planning_s"]) / row["steps"]
        print(f"{num_constrained:>17} | {row['steps']:>5.0f} | {iteration_ms:>26.1f} | "
              f"{1e3 * row['mask_s'] / row['steps']:>19.2f}")  # fmt: skip
    print(f"grammar compile: cold {1e3 * compile_s['miss']:.2f} ms, cached {1e3 * compile_s['hit']:.4f} ms")
    return {"rows": rows, "compile_s": compile_s}


def suite_prefix_cache(args: argparse.Namespace) -> dict[str, Any]:
    # A pool of 16,384 tokens: the random rounds fill it, so the cache also pays for LRU eviction.
    flags = ["--max-batch-total-tokens", "16384"]
    workload = ["--concurrency", "4", "--max-prompt-tokens", "512", "--max-output-tokens", "32"]
    reports: dict[str, Any] = {}
    with rill(args, "cache-off", *flags, "--no-prefix-caching") as off, rill(args, "cache-on", *flags) as on:
        for name in ("shared-prefix", "chat"):
            before = metrics(on)
            size = ["--workload", name, "--num-requests", str(args.num_requests)]
            reports[name] = compare(args, off, on, *size, *workload)
            reports[name]["hit_rate"] = hit_rate(before, metrics(on))
        reports["random"] = zero_hit_rounds(args, off, on, workload)
    print("\nworkload      | TTFT p50 off/on | output tokens/s on/off | hit rate")
    for name in ("shared-prefix", "chat"):
        r = reports[name]["ratios"]
        speedup = 1 / r["ttft_ms.p50"] if r["ttft_ms.p50"] else None
        print(f"{name:<13} | {ratio(speedup):>15} | {ratio(r['output_tokens_per_s']):>22} | "
              f"{100 * reports[name]['hit_rate']:.0f}%")  # fmt: skip
    print_zero_hit(reports["random"])
    return reports


def print_zero_hit(report: dict[str, Any]) -> None:
    rounds = ", ".join(f"{value:.3f}" for value in report["round_ratios"])
    print(
        f"{'random':<13} | {'':>15} | {ratio(report['pooled_ratio']):>22} | {100 * report['hit_rate']:.0f}%"
    )
    print(f"\nrandom prompts, output tokens/s on/off by round: {rounds}")
    print(f"  median {report['median_ratio']:.3f}, pooled {report['pooled_ratio']:.3f}; "
          f"{report['evicted_blocks']:.0f} cached blocks evicted")  # fmt: skip
    for side, engine in report["engine"].items():
        per_step_ms = 1e3 * engine["planning_s"] / engine["steps"]
        share = engine["planning_s"] / (engine["step_s"] + engine["planning_s"])
        print(f"  cache {side:<3}: router planning {per_step_ms:.3f} ms a step, {100 * share:.2f}% of it")


def hit_rate(before: dict[str, float], after: dict[str, float]) -> float:
    hits = after["rill_prefix_cache_hit_tokens_total"] - before["rill_prefix_cache_hit_tokens_total"]
    queried = (
        after["rill_prefix_cache_queried_tokens_total"] - before["rill_prefix_cache_queried_tokens_total"]
    )
    return hits / queried if queried else 0.0


def zero_hit_rounds(args: argparse.Namespace, off: Server, on: Server, workload: list[str]) -> dict[str, Any]:
    """The cost of the cache at a 0% hit rate: `--rounds` rounds of random prompts against both servers,
    the order alternating, new prompts each round (`compare --fresh-prompts`, from `--seed` + 1000, so the
    cache never holds them). Reports each round's throughput ratio (on/off), their median, the pooled
    ratio and the router's planning time per step on both sides: the cache's own work, free of the model
    forward's noise."""
    servers = {"off": off, "on": on}
    before = {side: metrics(server) for side, server in servers.items()}
    size = ["--workload", "random", "--num-requests", str(args.num_requests), "--rounds", str(args.rounds)]
    report = compare(args, off, on, *size, *workload, "--fresh-prompts", seed=args.seed + 1000)
    after = {side: metrics(server) for side, server in servers.items()}
    evicted = "rill_prefix_cache_evicted_blocks_total"
    return {
        "round_ratios": report["round_ratios"],
        "median_ratio": float(statistics.median(report["round_ratios"])),
        "pooled_ratio": report["ratios"]["output_tokens_per_s"],
        "hit_rate": hit_rate(before["on"], after["on"]),
        "evicted_blocks": after["on"][evicted] - before["on"][evicted],
        "engine": {side: engine_seconds(before[side], after[side]) for side in servers},
    }


SUITES = {
    "scheduling": suite_scheduling,
    "itl": suite_itl,
    "overhead": suite_overhead,
    "prefix-cache": suite_prefix_cache,
    "roofline": roofline.run,
    "peers": peers.run,
    "peers-gguf": peers.run_gguf,
    "dtypes": suite_dtypes,
    "constrained": suite_constrained,
    "agents": agents.run,
    "lora": lora.run,
    "speculative": speculative.run,
}


def int_list(text: str) -> list[int]:
    """`1,16` -> [1, 16]: positive integers, comma-separated."""
    values = [int(part) for part in text.split(",")]
    if any(value < 1 for value in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("suite", choices=SUITES, help="what to measure")
    parser.add_argument("--model-id", type=Path, help="model folder (default: the built-in model)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (default: %(default)s)")
    parser.add_argument("--num-threads", type=int, default=1, help="torch threads per shard (default: 1)")
    parser.add_argument("--router-bin", type=Path, default=os.environ.get("RILL_ROUTER_BIN"),
                        help="rill-router binary (default: what the launcher finds)")  # fmt: skip
    parser.add_argument("--num-requests", type=int, default=24, help="per side (default: %(default)s)")
    parser.add_argument("--rounds", type=int, default=6,
                        help="prefix-cache: rounds of 0%%-hit prompts; dtypes, lora: rounds of each pair "
                        "(default: %(default)s)")  # fmt: skip
    parser.add_argument("--target-itl-ms", type=float, default=500.0, help="for `itl` (default: %(default)s)")
    parser.add_argument("--tokenizer", type=Path, help="tokenizer.json for exact prompt lengths")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, help="write every figure here")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                        help="roofline, peers: the model's dtype (default: %(default)s)")  # fmt: skip
    parser.add_argument("--clients", type=int_list, default=[1, peers.CLIENTS],
                        help="peers-gguf: concurrent clients, comma-separated (default: 1,16)")  # fmt: skip
    parser.add_argument("--gguf-types", type=lambda text: text.split(","), default=["Q4_1", "Q8_0"],
                        help="peers-gguf: GGUF types of the default model, comma-separated: Q4_1 (its own "
                        "file), Q8_0 (llama.cpp's converter), others llama-quantize makes (default: "
                        "Q4_1,Q8_0); --model-id FILE.gguf serves that file instead")  # fmt: skip
    parser.add_argument("--repeats", type=int, default=5, help="roofline: timed steps per point")
    parser.add_argument("--quantized-activations", default="none",
                        choices=("none", "float32", "int16", "int8"),
                        help="roofline: serve the default model from its GGUF file as it is, its "
                        "quantized weights multiplying float32, int16 or int8 activations (none: expanded "
                        "to --dtype); peers-gguf: Rill's --quantized-activations (none: its "
                        "default)")  # fmt: skip
    parser.add_argument("--plot", type=Path, help="roofline: save the step-time plot here (PNG)")
    parser.add_argument(
        "--num-agents", type=int, default=4, help="agents: concurrent agents (default: %(default)s)"
    )
    parser.add_argument(
        "--num-turns", type=int, default=4, help="agents: turns per agent (default: %(default)s)"
    )
    parser.add_argument("--think-s", type=float, default=20.0,
                        help="agents: seconds between turns (default: %(default)s)")  # fmt: skip
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1, got {args.rounds}")
    result = SUITES[args.suite](args)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
