"""Rill's own benchmark suite: starts Rill in the configurations to compare, runs the same seeded workload
against each (back to back, in one run), and prints the ratios that the README reports.

    python -m bench.suite scheduling   # continuous vs --scheduling static (mixed workload)
    python -m bench.suite itl          # ITL while 4,000-token prompts arrive, with/without --target-itl-ms
    python -m bench.suite overhead     # share of each step outside the model forward at 1, 8, 32 sequences
    python -m bench.suite prefix-cache # shared prefix, 4-turn chat and random prompts, cache on vs off

Every suite runs the default model on the CPU unless `--device`/`--model-id` say otherwise; `--json PATH`
keeps every figure. The machine is shared and noisy: compare ratios measured in one run, not absolutes.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench import cli

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class Server:
    url: str
    process: subprocess.Popen[bytes]
    log: Path


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as response:
        return str(response.read().decode())


@contextmanager
def rill(args: argparse.Namespace, name: str, *flags: str) -> Iterator[Server]:
    """A Rill server started with `launcher.py` and these extra flags; stopped with SIGTERM on exit."""
    port = _free_port()
    log = Path(tempfile.gettempdir()) / f"rill-bench-{name}-{port}.log"
    command = [sys.executable, str(ROOT / "launcher.py"), "--port", str(port), "--device", args.device,
               "--num-threads", str(args.num_threads), *flags]  # fmt: skip
    if args.model_id:
        command += ["--model-id", str(args.model_id)]
    if args.router_bin:
        command += ["--router-bin", str(args.router_bin)]
    with open(log, "w") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT)
    url = f"http://127.0.0.1:{port}"
    print(f"[suite] starting {name}: {' '.join(flags) or '(defaults)'}; log {log}", flush=True)
    try:
        deadline = time.monotonic() + 900
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"{name} exited with {process.returncode}; see {log}")
            try:
                if _get(f"{url}/health") is not None:
                    break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"{name} not ready; see {log}")
            time.sleep(0.5)
        yield Server(url, process, log)
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            process.kill()


def metrics(server: Server) -> dict[str, float]:
    """The server's Prometheus samples by name (labels kept in the name)."""
    values: dict[str, float] = {}
    for line in _get(f"{server.url}/metrics").splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
    return values


def bench(args: argparse.Namespace, *argv: str) -> dict[str, Any]:
    """Runs `python -m bench ...` in-process with a JSON report and returns it."""
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as out:
        path = Path(out.name)
    common = ["--seed", str(args.seed), "--json", str(path)]
    if args.tokenizer:
        common += ["--tokenizer", str(args.tokenizer)]
    code = cli.main([*argv, *common])
    if code != 0:
        raise RuntimeError(f"bench {' '.join(argv)} failed with {code}")
    return dict(json.loads(path.read_text()))


def compare(args: argparse.Namespace, a: Server, b: Server, *argv: str) -> dict[str, Any]:
    return bench(args, "compare", "--a", f"a={a.url}", "--b", f"b={b.url}", "--no-progress", *argv)


def ratio(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}x"


def suite_scheduling(args: argparse.Namespace) -> dict[str, Any]:
    flags = ["--max-batch-size", "16", "--max-batch-total-tokens", "60000"]
    workload = ["--workload", "mixed", "--num-requests", str(args.num_requests), "--concurrency", "16",
                "--max-prompt-tokens", "512", "--max-output-tokens", "256"]  # fmt: skip
    with rill(args, "continuous", *flags) as continuous, rill(
        args, "static", *flags, "--scheduling", "static", "--static-batch-wait-ms", "2000"
    ) as static:
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


def suite_overhead(args: argparse.Namespace) -> dict[str, Any]:
    rows = {}
    with rill(args, "overhead", "--max-batch-total-tokens", "60000") as server:
        for concurrency in (1, 8, 32):
            before = metrics(server)
            bench(args, "run", "--url", server.url, "--no-progress", "--workload", "random",
                  "--num-requests", str(concurrency * 2), "--concurrency", str(concurrency),
                  "--max-prompt-tokens", "64", "--max-tokens", "48")  # fmt: skip
            after = metrics(server)
            step = after["rill_step_duration_seconds_sum"] - before["rill_step_duration_seconds_sum"]
            model = after["rill_model_forward_seconds_total"] - before["rill_model_forward_seconds_total"]
            steps = after["rill_step_duration_seconds_count"] - before["rill_step_duration_seconds_count"]
            rows[concurrency] = {
                "steps": steps, "step_s": step, "model_s": model, "outside_share": 1 - model / step,
            }  # fmt: skip
    print("\nrunning sequences | steps | mean step (ms) | outside the model forward")
    for concurrency, row in rows.items():
        print(f"{concurrency:>17} | {row['steps']:>5.0f} | {1e3 * row['step_s'] / row['steps']:>14.1f} | "
              f"{100 * row['outside_share']:.1f}%")  # fmt: skip
    return {"rows": rows}


def suite_prefix_cache(args: argparse.Namespace) -> dict[str, Any]:
    flags = ["--max-batch-total-tokens", "60000"]
    reports = {}
    with rill(args, "cache-off", *flags, "--no-prefix-caching") as off, rill(args, "cache-on", *flags) as on:
        for workload in ("shared-prefix", "chat", "random"):
            before = metrics(on)
            reports[workload] = compare(
                args, off, on, "--workload", workload, "--num-requests", str(args.num_requests),
                "--concurrency", "4", "--max-prompt-tokens", "512", "--max-output-tokens", "32",
            )  # fmt: skip
            after = metrics(on)
            hits = after["rill_prefix_cache_hit_tokens_total"] - before["rill_prefix_cache_hit_tokens_total"]
            queried_name = "rill_prefix_cache_queried_tokens_total"
            queried = after[queried_name] - before[queried_name]
            reports[workload]["hit_rate"] = hits / queried if queried else 0.0
    print("\nworkload      | TTFT p50 off/on | output tokens/s on/off | hit rate")
    for workload, report in reports.items():
        r = report["ratios"]
        speedup = 1 / r["ttft_ms.p50"] if r["ttft_ms.p50"] else None
        print(f"{workload:<13} | {ratio(speedup):>15} | {ratio(r['output_tokens_per_s']):>22} | "
              f"{100 * report['hit_rate']:.0f}%")  # fmt: skip
    return reports


SUITES = {
    "scheduling": suite_scheduling,
    "itl": suite_itl,
    "overhead": suite_overhead,
    "prefix-cache": suite_prefix_cache,
}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("suite", choices=SUITES, help="what to measure")
    parser.add_argument("--model-id", type=Path, help="model folder (default: the built-in model)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (default: %(default)s)")
    parser.add_argument("--num-threads", type=int, default=1, help="torch threads per shard (default: 1)")
    parser.add_argument("--router-bin", type=Path, default=os.environ.get("RILL_ROUTER_BIN"),
                        help="rill-router binary (default: what the launcher finds)")  # fmt: skip
    parser.add_argument("--num-requests", type=int, default=24, help="per side (default: %(default)s)")
    parser.add_argument("--target-itl-ms", type=float, default=500.0, help="for `itl` (default: %(default)s)")
    parser.add_argument("--tokenizer", type=Path, help="tokenizer.json for exact prompt lengths")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, help="write every figure here")
    args = parser.parse_args(argv)
    result = SUITES[args.suite](args)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
